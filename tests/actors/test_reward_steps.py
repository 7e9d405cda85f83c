"""Process supervision through the reward worker and the learner's advantages: a reward grades steps by character,
the worker places them on tokens with the run's tokenizer, and grpo_process credits each step's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from actors.learner.stages import add_advantages, to_step_batch
from actors.reward.step_tokens import token_ends
from bus.schema import Sample
from engines.training.base import DataParallel
from policies.config import PolicyLossConfig
from policies.rewards import RewardInput
from tests.actors.test_reward_prescored import _worker

_WORKING = ["Tom has 23 apples. He buys 7 more, so he has 23 + 7 = 30 apples.",
            "Then he gives 5 away: 30 - 5 = 25 apples. Then he finds 3 more, so 25 + 3 = 28 apples.",
            "Anna had 61 shells, and 61 - 3 = 58. So Anna has 58 shells now."]


def _merging_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on the sentences above: most of its tokens span several characters, and one
    can end one sentence and start the next."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_WORKING * 20, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.unit
def test_a_step_ends_on_the_token_that_completes_its_text() -> None:
    tokenizer = _merging_tokenizer()
    text = " ".join(_WORKING)
    ids = tokenizer.encode(text)
    assert len(ids) < len(text) / 2  # the tokens do span characters

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part)

    char_ends = [index + 1 for index, character in enumerate(text) if character == "."]
    placed = token_ends(decode, ids, text, char_ends)
    assert placed.dtype == np.int32 and len(placed) == len(char_ends)
    for end, token in zip(char_ends, placed.tolist(), strict=True):
        assert len(decode(ids[:token + 1])) >= end > len(decode(ids[:token]))
    assert token_ends(decode, ids, text, [len(text)]).tolist() == [len(ids) - 1]
    with pytest.raises(ValueError, match=f"ends at character {len(text) + 1}, outside the response's 1..{len(text)}"):
        token_ends(decode, ids, text, [len(text) + 1])
    with pytest.raises(ValueError, match="not its token ids decoded"):
        token_ends(decode, ids, text + " (edited)", [3])


def graded_by_sentence(inp: RewardInput) -> dict:
    """A reward that grades each sentence: right when it ends on "30." or "25.", a step of reward 0 otherwise."""
    ends = [index + 1 for index, character in enumerate(inp.response) if character == "."]
    steps = [[end, float(inp.response[:end].endswith(("30.", "25.")))] for end in ends]
    if inp.label == "overrun":
        steps.append([len(inp.response) + 5, 1.0])
    return {"reward": sum(r for _, r in steps) / max(len(steps), 1), "step_rewards": steps}


def _sample(index: int, response: str, tokenizer: PreTrainedTokenizerFast, label: str = "") -> Sample:
    prompt = tokenizer.encode("Q: ")
    response_ids = [*tokenizer.encode(response), tokenizer.eos_token_id]  # decoded without it (skip_special_tokens)
    return Sample(sample_id=f"g/{index}", group_id="g", index=index, prompt="Q: ", prompt_tokens=len(prompt),
                  tokens=np.asarray(prompt + response_ids, dtype=np.int32), response=response,
                  response_length=len(response_ids), label=label, status="completed")


@pytest.mark.integration
async def test_the_reward_worker_places_graded_steps_and_the_learner_credits_them(tmp_path: Path,
                                                                                 tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    right = "He has 23 + 7 = 30. Then 30 - 5 = 25."
    slipped = "He has 23 + 7 = 30. Then 30 - 5 = 26."
    samples = [_sample(0, right, tokenizer), _sample(1, slipped, tokenizer), _sample(2, right, tokenizer, "overrun")]
    async with _worker(tmp_path, custom_rm_path="tests.actors.test_reward_steps:graded_by_sentence",
                       hf_checkpoint=str(tiny_model_path)) as worker:
        scored = await worker.score_samples(samples)
        evaluated = await worker.score_samples(samples[:1], is_eval=True)
    first_end = right.index(".")  # the tiny tokenizer has a token a character: the step ends on its "."
    assert scored[0].step_ends.tolist() == [first_end, len(right)]  # the last step ends on the EOS token
    assert scored[0].step_rewards.tolist() == [1.0, 1.0] and scored[1].step_rewards.tolist() == [1.0, 0.0]
    assert scored[2].status == "failed" and "outside the response's" in scored[2].error  # named, not trained
    assert evaluated[0].reward == 1.0 and evaluated[0].step_ends is None  # an eval round trains nothing

    # The learner: the slip's first sentence is pushed up with the right answer's, its second down.
    policy = PolicyLossConfig(advantage_estimator="grpo_process", step_discount=0.0)
    batch = to_step_batch(scored[:2], rewarded=True)
    assert add_advantages(policy, batch, DataParallel(rank=0, size=1)) == {"rollout/graded_steps": 2.0}
    slip = batch.samples[1].advantages
    assert (slip[:first_end + 1] > 0).all() and (slip[first_end + 1:] < 0).all()
    outcome = to_step_batch(scored[:2], rewarded=True)
    add_advantages(PolicyLossConfig(advantage_estimator="grpo"), outcome, DataParallel(rank=0, size=1))
    assert (outcome.samples[1].advantages < 0).all()
    assert torch.equal(batch.samples[0].advantages > 0, torch.ones(len(right) + 1, dtype=torch.bool))
