"""A reward function sees more than the decoded text: the token ids and why generation ended, so it can check for
EOS or penalise truncation. Ours gets `RewardInput.prompt_ids/response_ids/finish_reason`; a slime-style one gets
slime's `sample.tokens`, `response_length` and `status`.

The runs are the real in-process pipeline (controller, buffer, sleeping rollout worker, real reward worker on real
sockets): the sleeping engine ends a response at `--rollout-max-response-len` with "length" and a shorter one with
"stop", as an engine does on EOS.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from actors.slime_compat import Sample as SlimeSample
from bus.schema import Sample
from examples.truncation_aware_rm import reward as truncation_aware_reward
from policies.rewards import reward_input
from tests.support import reward_plugins
from tests.support.inprocess import SLEEPING, actor_system, use_spec, write_prompts
from tools.sim.pipeline import SimSpec, SleepingTokenizer

MAX_RESPONSE = 24
ROLES = {"controller": "controller", "buffer": "buffer", "reward": "reward", "rollout": "rollout"}
SPEC = SimSpec(token_seconds=1e-4, length_min=8, length_max=48, length_median=MAX_RESPONSE, correct_fraction=1.0)


def _settings(tmp_path: Path, rm: str) -> dict[str, object]:
    return {**SLEEPING, "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "rollout_batch_size": 2,
            "n_samples_per_prompt": 4, "rollout_max_batch_size": 4, "rollout_max_response_len": MAX_RESPONSE,
            "custom_rm_path": rm, "use_tensorboard": False, "plots": False}


def _sample(status: str, response_ids: list[int], label: str = "7") -> Sample:
    prompt = list(b"3+4=")
    return Sample(sample_id="g/0", group_id="g", index=0, prompt="3+4=", prompt_tokens=len(prompt),
                  tokens=np.asarray(prompt + response_ids, dtype=np.int32),
                  response=SleepingTokenizer().decode(response_ids), response_length=len(response_ids), label=label,
                  status=status)


@pytest.mark.unit
def test_reward_input_carries_the_token_ids_and_the_finish_reason_of_each_status() -> None:
    inputs = {status: reward_input(_sample(status, [55, 10])) for status in ("completed", "truncated", "aborted")}
    assert {s: i.finish_reason for s, i in inputs.items()} == {"completed": "stop", "truncated": "length",
                                                               "aborted": "abort"}
    assert inputs["completed"].prompt_ids == list(b"3+4=") and inputs["completed"].response_ids == [55, 10]
    assert reward_input(_sample("pending", [55])).finish_reason is None  # a status no engine finish maps to


@pytest.mark.unit
def test_truncation_aware_example_scores_a_cut_off_right_answer_zero() -> None:
    right = list(b"\\boxed{7}")
    assert truncation_aware_reward(reward_input(_sample("completed", right))) == 1.0
    assert truncation_aware_reward(reward_input(_sample("truncated", right))) == 0.0
    assert truncation_aware_reward(reward_input(_sample("completed", list(b"\\boxed{5}")))) == 0.0


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_custom_reward_sees_token_ids_and_length_for_truncated_stop_for_ended_responses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reward_plugins.SEEN.clear()
    use_spec(SPEC, tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path, "tests.support.reward_plugins:record"), ROLES) as system:
        await system.wait_for(lambda: {i.finish_reason for i in reward_plugins.SEEN} == {"stop", "length"}, 20,
                              "a truncated and an ended response at the reward function")
        seen = list(reward_plugins.SEEN)  # before the stop: the generation it cuts reaches the reward as "abort"
    tokenizer = SleepingTokenizer()
    for inp in seen:
        assert tokenizer.decode(inp.prompt_ids) == inp.prompt
        assert tokenizer.decode(inp.response_ids) == inp.response  # the ids are the response's own
        if inp.finish_reason == "length":
            assert len(inp.response_ids) == MAX_RESPONSE
        else:
            assert inp.finish_reason == "stop" and len(inp.response_ids) < MAX_RESPONSE


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_slime_style_reward_sees_tokens_response_length_and_truncated_or_completed_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reward_plugins.SEEN_SLIME.clear()
    use_spec(SPEC, tmp_path, monkeypatch)
    rm = "tests.support.reward_plugins:record_slime"
    async with actor_system(tmp_path, _settings(tmp_path, rm), ROLES) as system:
        await system.wait_for(lambda: {s.status for s in reward_plugins.SEEN_SLIME} == {
            SlimeSample.Status.COMPLETED, SlimeSample.Status.TRUNCATED}, 20, "both statuses at the reward function")
        # Before the stop: the generation it cuts reaches the reward aborted, possibly with no response token
        # (seen in CI: `tokens[:-0]` is empty, so its "prompt" decoded to '').
        seen = list(reward_plugins.SEEN_SLIME)
    tokenizer = SleepingTokenizer()
    for sample in seen:
        prompt_ids, response_ids = sample.tokens[:-sample.response_length], sample.tokens[-sample.response_length:]
        assert tokenizer.decode(prompt_ids) == sample.prompt and tokenizer.decode(response_ids) == sample.response
        truncated = sample.status == SlimeSample.Status.TRUNCATED
        assert (sample.response_length == MAX_RESPONSE) == truncated
