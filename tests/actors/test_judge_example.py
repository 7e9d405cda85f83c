"""examples/judge: the judge's verdict is the model's P("yes") after the judging prompt, however its calls are
batched; the reward function reaches a real judge actor over real sockets from a real reward worker, and each
sample's reward is the judge's verdict; with no judge the samples fail naming it, and the worker counts them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import examples.judge.reward
from actors.config import ConfigError
from actors.plugins import Actor, handles
from bus.schema import GeneratedGroup, Sample, ScoredGroup
from examples.judge.actor import Judge, JudgeSettings, YesNoScorer
from tests.support.inprocess import actor_system

JUDGE_REWARD = "examples.judge.reward:judge_reward"
ANSWERS = [("What is 3 + 4?", "7", "7"), ("What is 12 + 30?", "It is 42, I think.", "42"),
           ("Name a colour.", "blue", None)]


@pytest.fixture
def scorer(tiny_model_path: Path) -> YesNoScorer:
    return YesNoScorer.load(str(tiny_model_path), "cpu")


def _unpadded_p_yes(scorer: YesNoScorer, prompt_ids: list[int]) -> float:
    """The verdict computed the plain way: each answer after the prompt, alone, every position's logits."""
    totals = []
    for answer in scorer.answers:
        log_probs = scorer.model(input_ids=torch.tensor([prompt_ids + answer])).logits[0].float().log_softmax(-1)
        totals.append(sum(log_probs[len(prompt_ids) - 1 + offset, token] for offset, token in enumerate(answer)))
    return torch.stack(totals).softmax(-1)[0].item()


@pytest.mark.integration
def test_a_batch_of_verdicts_equals_each_computed_alone_over_every_logit(scorer: YesNoScorer) -> None:
    prompts = [scorer.prompt_ids(*answer) for answer in ANSWERS]
    assert len({len(ids) for ids in prompts}) == 3  # left padding is exercised
    batched = scorer.yes_probabilities(prompts)
    for ids, verdict in zip(prompts, batched, strict=True):
        assert 0.0 < verdict < 1.0
        assert verdict == pytest.approx(_unpadded_p_yes(scorer, ids), rel=1e-5)


@pytest.mark.unit
def test_judge_settings_refuse_a_missing_model_or_a_bad_batch_by_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUDGE_MODEL", raising=False)
    with pytest.raises(ConfigError, match=r"^JUDGE_MODEL is not set"):
        JudgeSettings.from_environment()
    monkeypatch.setenv("JUDGE_MODEL", "some/model")
    monkeypatch.setenv("JUDGE_MAX_BATCH", "0")
    with pytest.raises(ConfigError, match=r"^JUDGE_MAX_BATCH='0': expected a whole number >= 1$"):
        JudgeSettings.from_environment()


class FakeBuffer(Actor):
    """Plays the buffer: hands groups to the reward worker as a rollout worker would, and keeps what comes back."""

    async def on_start(self) -> None:
        self.scored: list[ScoredGroup] = []
        self.reward = self.peer_stream("reward")

    @handles(ScoredGroup)
    async def on_scored(self, sender: str, group: ScoredGroup) -> None:
        self.scored.append(group)


def _group(group_id: str) -> GeneratedGroup:
    samples = [Sample(sample_id=f"{group_id}/{index}", group_id=group_id, index=index, prompt=prompt, prompt_tokens=1,
                      tokens=np.array([1, 2], dtype=np.int32), response=response, response_length=1, label=label,
                      loss_mask=np.ones(1, dtype=np.int8), status="completed")
               for index, (prompt, response, label) in enumerate(ANSWERS)]
    return GeneratedGroup(lease_id="-", group_id=group_id, samples=samples, worker_id="rollout-0-0")


def _settings() -> dict[str, object]:
    return {"custom_rm_path": JUDGE_REWARD, "use_tensorboard": False, "plots": False}


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_each_reward_is_the_verdict_of_a_real_judge_actor(tmp_path: Path, tiny_model_path: Path,
                                                                scorer: YesNoScorer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_MODEL", str(tiny_model_path))
    roles = {"controller": "controller", "judge": Judge, "buffer": FakeBuffer, "reward": "reward"}
    async with actor_system(tmp_path, _settings(), roles) as system:
        buffer = system["buffer"]
        for index in range(2):
            await buffer.reward.send(_group(f"g{index}"), timeout=10)
        await system.wait_for(lambda: len(buffer.scored) == 2, 60, "both groups scored")
        judge = system["judge-0-0"]
    expected = scorer.yes_probabilities([scorer.prompt_ids(*answer) for answer in ANSWERS])
    for group in buffer.scored:
        assert [sample.status for sample in group.samples] == ["completed"] * 3
        assert [sample.reward for sample in group.samples] == pytest.approx(expected, rel=1e-5)
    ledger = [json.loads(line) for line in (tmp_path / "judge" / "judge-0-0.jsonl").read_text().splitlines()]
    assert judge.counters["judge.verdicts"] == len(ledger) == 6
    verdicts = {(entry["prompt"], entry["response"]): entry["p_yes"] for entry in ledger}
    for group in buffer.scored:  # bit for bit what the judge said
        assert [verdicts[(s.prompt, s.response)] for s in group.samples] == [s.reward for s in group.samples]


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_with_no_judge_the_samples_fail_naming_it_and_the_reward_worker_counts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(examples.judge.reward, "JUDGE_TIMEOUT_S", 0.5)
    roles = {"controller": "controller", "buffer": FakeBuffer, "reward": "reward"}
    async with actor_system(tmp_path, _settings(), roles) as system:
        buffer = system["buffer"]
        await buffer.reward.send(_group("g0"), timeout=10)
        await system.wait_for(lambda: len(buffer.scored) == 1, 30, "the group back")
        worker = system["reward-0-0"]
        assert worker.counters["samples.reward_failed"] == 3
        assert not worker.stopping  # under --reward-failure-limit: it goes on serving
    (group,) = buffer.scored
    assert [sample.status for sample in group.samples] == ["failed"] * 3
    assert group.samples[0].error.startswith("reward: raised ActorCallError: no live 'judge' actor to call score "
                                             "within 0.5 s (is one started, with --custom-actor judge=MODULE:CLASS")
