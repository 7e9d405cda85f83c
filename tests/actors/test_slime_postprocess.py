"""slime's --rollout-data-postprocess-path: fn(args, rollout_id, rollout_data) after the advantages; the loss masks
and advantages it leaves are what the optimizer step trains on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from actors.config import build_config
from actors.learner.step import TrainingStep
from actors.slime_compat.postprocess import load_rollout_data_postprocess
from bus.schema import Sample
from tests.actors.test_learner_step import generate, groups
from tests.actors.test_learner_steps_per_rollout import _trainer

HERE = __name__
SEEN: dict[str, Any] = {}


def mask_the_first_token_double_the_advantages(args, rollout_id, rollout_data):
    """slime's documented use: a loss mask from the computed values (here: the first token never trains)."""
    SEEN.update(rollout_id=rollout_id, keys=sorted(rollout_data), advantages=[a.clone() for a in
                                                                              rollout_data["advantages"]])
    for mask in rollout_data["loss_masks"]:
        mask[0] = 0
    rollout_data["advantages"] = [2 * a for a in rollout_data["advantages"]]


def masks_of_twos(args, rollout_id, rollout_data):
    rollout_data["loss_masks"] = [2 * m for m in rollout_data["loss_masks"]]


@pytest.fixture(scope="module")
def engine_samples(tiny_model_path: Path) -> list[Sample]:
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 5})
    samples = generate(tiny_model_path, config, groups(2))
    return [msgspec.structs.replace(s, reward=float(i % 2)) for i, s in enumerate(samples)]


def _config(model: Path, plugin: str):
    return build_config({"hf_checkpoint": str(model), "rollout_batch_size": 2, "n_samples_per_prompt": 4,
                         "lr": 1e-2, "rollout_data_postprocess_path": f"{HERE}:{plugin}"})


@pytest.mark.integration
def test_the_step_trains_on_the_loss_masks_and_advantages_the_postprocess_leaves(
        tiny_model_path: Path, engine_samples: list[Sample]) -> None:
    trainer = _trainer(tiny_model_path)
    SEEN.clear()
    TrainingStep(trainer, _config(tiny_model_path, "mask_the_first_token_double_the_advantages")).train(
        engine_samples, [0] * len(engine_samples))
    [(seen, _ends)] = trainer.steps
    assert SEEN["rollout_id"] == 0  # the first batch trains from version 0
    assert {"advantages", "returns", "loss_masks", "rewards", "tokens", "log_probs"} <= set(SEEN["keys"])
    for wire, sample, before in zip(engine_samples, seen, SEEN["advantages"], strict=True):
        assert sample.loss_mask.tolist() == [0.0] + [1.0] * (wire.response_length - 1)
        expected = 2 * before * sample.loss_mask
        assert torch.equal(sample.advantages, expected)
    assert any(bool(a.any()) for a in SEEN["advantages"])  # the doubled advantages are not all zero


@pytest.mark.integration
def test_a_loss_mask_that_is_not_zeros_and_ones_is_an_error_naming_the_hook(tiny_model_path: Path,
                                                                            engine_samples: list[Sample]) -> None:
    trainer = _trainer(tiny_model_path)
    with pytest.raises(ValueError, match=r"--rollout-data-postprocess-path .*masks_of_twos.*loss_masks'\]\[0\] "
                                         "holds values other than 0 and 1"):
        TrainingStep(trainer, _config(tiny_model_path, "masks_of_twos")).train(engine_samples,
                                                                               [0] * len(engine_samples))
    assert load_rollout_data_postprocess(build_config({})) is None


def train_on_high_entropy_tokens(args, rollout_id, rollout_data):
    """slime's use of --use-rollout-entropy: a loss mask keeping each sample's above-median-entropy tokens."""
    SEEN.update(entropy=[e.clone() for e in rollout_data["entropy"]])
    rollout_data["loss_masks"] = [(e > e.median()).int() for e in rollout_data["entropy"]]


@pytest.mark.integration
@pytest.mark.parametrize("pi_old", ["separate", "rollout"], ids=["with-pi-old-forward", "engine-pi-old"])
def test_rollout_entropy_is_the_policys_before_the_step_and_reaches_the_hooks(
        tiny_model_path: Path, engine_samples: list[Sample], pi_old: str) -> None:
    """--use-rollout-entropy: each token's entropy under the policy before the update, in rollout_data['entropy']
    (a loss mask made from it trains) and as rollout/entropy; taken in pi_old's forward, or one of its own where
    pi_old is the engine's (--use-rollout-logprobs)."""
    from engines.training.base import TrainSample

    trainer = _trainer(tiny_model_path)
    expected = trainer.compute_log_probs([TrainSample(tokens=torch.tensor(s.tokens), response_length=s.response_length)
                                          for s in engine_samples], temperature=1.0, with_entropy=True).entropy
    extra = {"use_rollout_logprobs": True} if pi_old == "rollout" else {"use_decoupled_ppo": True}
    config = build_config({"hf_checkpoint": str(tiny_model_path), "rollout_batch_size": 2, "n_samples_per_prompt": 4,
                           "lr": 1e-2, "use_rollout_entropy": True, **extra,
                           "rollout_data_postprocess_path": f"{HERE}:train_on_high_entropy_tokens"})
    SEEN.clear()
    report = TrainingStep(trainer, config).train(engine_samples, [0] * len(engine_samples))
    torch.testing.assert_close(torch.cat(SEEN["entropy"]), expected.float())
    [(seen, _ends)] = trainer.steps
    for sample, entropy in zip(seen, SEEN["entropy"], strict=True):
        assert sample.loss_mask.tolist() == (entropy > entropy.median()).float().tolist()
    # slime logs after the hook, over the loss masks it left: each sample's mean over its kept tokens
    means = [float((e * (e > e.median())).sum() / max(1, int((e > e.median()).sum()))) for e in SEEN["entropy"]]
    assert report.metrics["rollout/entropy"] == pytest.approx(sum(means) / len(means))
    assert "rollout/entropy" in report.rollout


def advantages_from_rewards(args, rollout_id, rollout_data):
    """What a slime user writes with --disable-compute-advantages-and-returns: the advantages themselves."""
    SEEN.update(advantages=[a.clone() for a in rollout_data["advantages"]])
    rollout_data["advantages"] = [torch.full_like(a, reward - 0.5)
                                  for a, reward in zip(rollout_data["advantages"], rollout_data["rewards"],
                                                       strict=True)]


@pytest.mark.integration
def test_with_advantages_disabled_the_hook_gets_zeros_and_its_advantages_train(
        tiny_model_path: Path, engine_samples: list[Sample]) -> None:
    trainer = _trainer(tiny_model_path)
    config = build_config({"hf_checkpoint": str(tiny_model_path), "rollout_batch_size": 2, "n_samples_per_prompt": 4,
                           "lr": 1e-2, "disable_compute_advantages_and_returns": True,
                           "disable_rewards_normalization": True,
                           "rollout_data_postprocess_path": f"{HERE}:advantages_from_rewards"})
    SEEN.clear()
    TrainingStep(trainer, config).train(engine_samples, [0] * len(engine_samples))
    assert all(not bool(a.any()) for a in SEEN["advantages"])  # nothing computed: the estimator did not run
    [(seen, _ends)] = trainer.steps
    for wire, sample in zip(engine_samples, seen, strict=True):
        assert sample.advantages.tolist() == [wire.reward - 0.5] * wire.response_length


def remove_each_groups_last(args, groups):
    """slime's --rollout-sample-filter-path: marks samples; slime trains nothing of them (its contract test's)."""
    SEEN.update(groups=[[s.index for s in group] for group in groups])
    for group in groups:
        group[-1].remove_sample = True


@pytest.mark.integration
def test_the_rollout_sample_filter_removes_exactly_the_marked_samples_from_the_trained_batch(
        tiny_model_path: Path, engine_samples: list[Sample]) -> None:
    """The marked samples train nothing (an all-zero loss mask, so they are not in the optimizer's samples at all);
    the others train as without the filter, advantages included: the marked ones still count in their group's
    reward normalisation, as slime's note says."""
    plain, filtered = _trainer(tiny_model_path), _trainer(tiny_model_path)
    base = {"hf_checkpoint": str(tiny_model_path), "rollout_batch_size": 2, "n_samples_per_prompt": 4, "lr": 1e-2}
    TrainingStep(plain, build_config(base)).train(engine_samples, [0] * len(engine_samples))
    SEEN.clear()
    report = TrainingStep(filtered, build_config({**base, "rollout_sample_filter_path": f"{HERE}:"
                                                  "remove_each_groups_last"})).train(engine_samples,
                                                                                      [0] * len(engine_samples))
    by_group: dict[str, list[int]] = {}
    for sample in engine_samples:
        by_group.setdefault(sample.group_id, []).append(sample.index)
    assert SEEN["groups"] == list(by_group.values()) and len(by_group) > 1  # whole groups, in the batch's order
    [(every, _)], [(trained, _)] = plain.steps, filtered.steps
    marked = {tuple(s.tokens.tolist()) for s in engine_samples if s.index == by_group[s.group_id][-1]}
    trained_by_tokens = {tuple(s.tokens.tolist()): s for s in trained}
    assert marked and not marked & set(trained_by_tokens), "a marked sample is in the optimizer's batch"
    kept = [s for s in every if tuple(s.tokens.tolist()) not in marked]
    assert sorted(trained_by_tokens) == sorted(tuple(s.tokens.tolist()) for s in kept)
    for before in kept:
        after = trained_by_tokens[tuple(before.tokens.tolist())]
        assert torch.equal(after.loss_mask, before.loss_mask)
        torch.testing.assert_close(after.advantages, before.advantages)
    assert report.metrics["rollout/samples"] == len(engine_samples)


def mark_with_a_number(args, groups):
    groups[0][0].remove_sample = 1


@pytest.mark.unit
def test_a_rollout_sample_filter_that_marks_with_a_non_bool_is_an_error_naming_it(
        engine_samples: list[Sample]) -> None:
    from actors.extensions.load import batch_rewrite

    rewrite = batch_rewrite(build_config({"rollout_sample_filter_path": f"{HERE}:mark_with_a_number"}))
    assert rewrite is not None and not rewrite.rewards_as_given
    with pytest.raises(TypeError, match=r"--rollout-sample-filter-path .*mark_with_a_number.*set remove_sample of "
                                        r"sample \S+ to 1; expected True or False"):
        rewrite(list(engine_samples))
