"""slime's learner hooks: --custom-advantage-function-path and --custom-convert-samples-to-train-data-path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from actors.config import build_config
from actors.learner.stages import StepBatch, add_advantages, own_shard
from actors.learner.step import TrainingStep
from actors.slime_compat import Sample as SlimeSample
from actors.slime_compat.advantages import load_custom_advantages
from actors.slime_compat.train_data import load_convert_samples
from bus.schema import Sample
from engines.training.base import DataParallel, TrainSample
from policies.advantages import group_normalize, whiten
from tests.actors.test_learner_step import generate, groups
from tests.actors.test_learner_steps_per_rollout import _trainer
from tests.support.rendezvous import rendezvous_file

HERE = __name__
SINGLE = DataParallel(rank=0, size=1)
SEEN: dict[str, Any] = {}


# ----------------------------------------------------------------------------------------------------------------
# Plugins in slime's style, loaded by path below


def reward_plus_position(args, rollout_data):
    """Per-token advantages = the sample's (post-processed) reward plus the token's position, which no built-in
    estimator gives; records what it was given."""
    SEEN["data"] = dict(rollout_data)
    SEEN["args"] = args
    rollout_data["advantages"] = [float(r) + torch.arange(n, dtype=torch.float32) for r, n in
                                  zip(rollout_data["rewards"], rollout_data["response_lengths"], strict=True)]
    rollout_data["returns"] = rollout_data["advantages"]


def _by_plugin(reward: float, length: int) -> torch.Tensor:
    return reward + torch.arange(length, dtype=torch.float32)


def one_too_short(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(n) for n in rollout_data["response_lengths"]]
    rollout_data["advantages"][1] = torch.zeros(rollout_data["response_lengths"][1] - 1)
    rollout_data["returns"] = rollout_data["advantages"]


def nan_on_a_trained_token(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(n) for n in rollout_data["response_lengths"]]
    rollout_data["advantages"][2][0] = float("nan")
    rollout_data["returns"] = rollout_data["advantages"]


def forgets_returns(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(n) for n in rollout_data["response_lengths"]]


def one_sample_short(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(n) for n in rollout_data["response_lengths"][:-1]]
    rollout_data["returns"] = rollout_data["advantages"]


def mask_first_token_reward_by_index(args, samples):
    """slime's (args, samples) -> dict: the first response token untrained, reward = position in the group - 1.5."""
    masks = []
    for sample in samples:
        mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * sample.response_length
        masks.append([0, *mask[1:]] if mask else mask)
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "rewards": [float(s.index) - 1.5 for s in samples], "loss_masks": masks,
            "truncated": [0] * len(samples), "sample_indices": [s.index for s in samples]}


def drops_the_last_sample(args, samples):
    return mask_first_token_reward_by_index(args, samples[:-1])


def cuts_the_response_to_one_token(args, samples, *, with_log_probs: bool = False):
    data = {"tokens": [s.tokens[:len(s.tokens) - s.response_length + 1] for s in samples],
            "response_lengths": [1] * len(samples), "rewards": [1.0] * len(samples),
            "loss_masks": [[1] for _ in samples]}
    if with_log_probs:
        data["rollout_log_probs"] = [[-0.25] for _ in samples]
    return data


def cuts_with_log_probs(args, samples):
    return cuts_the_response_to_one_token(args, samples, with_log_probs=True)


def never_called(args, samples):
    raise AssertionError("slime never calls the reward post-process when a convert function is set")


# ----------------------------------------------------------------------------------------------------------------
# The advantage hook, on hand-built shards


def _shard(*, with_log_probs: bool = False) -> StepBatch:
    """Two groups of three; the second sample's last token and the fifth's first are untrained."""
    generator = torch.Generator().manual_seed(3)
    samples, group_ids = [], []
    for index in range(6):
        length = 3 + index % 2
        mask = torch.ones(length)
        if index == 1:
            mask[-1] = 0
        if index == 4:
            mask[0] = 0
        sample = TrainSample(torch.randint(6, 100, (length + 2,), generator=generator), length, loss_mask=mask,
                             reward=float(index % 3), rollout_log_probs=-torch.rand(length, generator=generator))
        if with_log_probs:
            sample.old_log_probs = -torch.rand(length, generator=generator)
            sample.ref_log_probs = -torch.rand(length, generator=generator)
        samples.append(sample)
        group_ids.append(f"g{index // 3}")
    return StepBatch(samples=samples, group_ids=group_ids)


def _hook(plugin: str, **flags: Any):
    SEEN.clear()
    config = build_config({"custom_advantage_function_path": f"{HERE}:{plugin}", **flags})
    return config, load_custom_advantages(config)


@pytest.mark.unit
def test_the_advantage_hook_gets_slime_rollout_data_with_group_normalised_rewards() -> None:
    config, hook = _hook("reward_plus_position")
    batch = _shard()
    add_advantages(config.policy, batch, SINGLE, custom=hook)
    data = SEEN["data"]
    assert SEEN["args"].custom_advantage_function_path == f"{HERE}:reward_plus_position"
    assert data["response_lengths"] == batch.lengths
    assert data["total_lengths"] == [n + 2 for n in batch.lengths]
    expected = group_normalize(torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 2.0]), torch.tensor([0, 0, 0, 1, 1, 1]),
                               divide_by_std=True, eps=1e-6)
    assert data["rewards"] == pytest.approx(expected.tolist())  # grpo: centred and divided by the group std
    assert all(m.dtype == torch.int32 for m in data["loss_masks"])
    assert data["loss_masks"][1].tolist() == [1, 1, 1, 0]
    for sample, log_probs, kl in zip(batch.samples, data["log_probs"], data["kl"], strict=True):
        torch.testing.assert_close(log_probs, sample.rollout_log_probs)  # pi_old is mu on this path
        assert torch.equal(kl, torch.zeros(sample.response_length))  # kl_coef 0: zeros, as slime
    assert "ref_log_probs" not in data and "values" not in data


@pytest.mark.unit
def test_the_hook_advantages_are_what_the_step_trains_on_after_masking() -> None:
    config, hook = _hook("reward_plus_position", disable_rewards_normalization=True)  # rewards as given
    batch = _shard()
    add_advantages(config.policy, batch, SINGLE, custom=hook)
    for sample in batch.samples:
        assert torch.equal(sample.advantages, _by_plugin(sample.reward, sample.response_length) * sample.loss_mask)
    assert batch.samples[1].advantages.tolist() == [1.0, 2.0, 3.0, 0.0]
    assert batch.samples[4].advantages.tolist() == [0.0, 2.0, 3.0]


@pytest.mark.unit
def test_the_hook_advantages_are_whitened_with_normalize_advantages() -> None:
    config, hook = _hook("reward_plus_position", disable_rewards_normalization=True, normalize_advantages=True)
    batch = _shard()
    add_advantages(config.policy, batch, SINGLE, custom=hook)
    mask = batch.packed("loss_mask")
    raw = torch.cat([_by_plugin(s.reward, s.response_length) for s in batch.samples])
    torch.testing.assert_close(batch.packed("advantages"), whiten(raw, mask))
    assert float(batch.packed("advantages")[mask > 0].mean()) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.unit
def test_the_hook_sees_the_kl_penalty_source_when_kl_coef_is_set() -> None:
    config, hook = _hook("reward_plus_position", kl_coef=0.1, kl_loss_type="k1")
    batch = _shard(with_log_probs=True)
    add_advantages(config.policy, batch, SINGLE, custom=hook)
    data = SEEN["data"]
    for sample, kl, log_probs, ref in zip(batch.samples, data["kl"], data["log_probs"], data["ref_log_probs"],
                                          strict=True):
        torch.testing.assert_close(log_probs, sample.old_log_probs)  # pi_old, the step's, not mu
        torch.testing.assert_close(ref, sample.ref_log_probs)
        torch.testing.assert_close(kl, sample.old_log_probs - sample.ref_log_probs)


@pytest.mark.unit
@pytest.mark.parametrize(("plugin", "message"), [
    ("one_too_short", r"rollout_data\['advantages'\]\[1\]: expected 4 values \(the sample's response length\)"),
    ("nan_on_a_trained_token", r"rollout_data\['advantages'\]\[2\]: non-finite value nan at trained token 0"),
    ("forgets_returns", r"rollout_data\['returns'\] was not set"),
    ("one_sample_short", r"rollout_data\['advantages'\] has 5 entries for 6 samples"),
], ids=["wrong-length", "nan", "missing-key", "wrong-count"])
def test_a_bad_advantage_return_is_an_error_naming_the_plugin(plugin: str, message: str) -> None:
    config, hook = _hook(plugin)
    with pytest.raises(ValueError, match=rf"--custom-advantage-function-path '{HERE}:{plugin}': {message}"):
        add_advantages(config.policy, _shard(), SINGLE, custom=hook)


@pytest.mark.unit
def test_the_example_discounted_return_is_reinforce_plus_plus() -> None:
    flags = {"normalize_advantages": True, "kl_coef": 0.05, "gamma": 0.9, "kl_loss_type": "k3"}
    # The plugin runs in place of grpo (whose rewards slime would not normalise here), the reference is the built-in.
    config = build_config({**flags, "disable_rewards_normalization": True, "custom_advantage_function_path":
                           "examples.slime_style.advantage.discounted_return"})  # slime's dotted spelling
    reference = build_config({**flags, "advantage_estimator": "reinforce_plus_plus"})
    by_plugin, built_in = _shard(with_log_probs=True), _shard(with_log_probs=True)
    add_advantages(config.policy, by_plugin, SINGLE, custom=load_custom_advantages(config))
    add_advantages(reference.policy, built_in, SINGLE)
    torch.testing.assert_close(by_plugin.packed("advantages"), built_in.packed("advantages"))


def _hook_on_rank(rank: int, rendezvous: str, out_dir: Path) -> None:
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    try:
        config, hook = _hook("reward_plus_position", normalize_advantages=True)
        batch = _shard()
        ids = {id(sample): index for index, sample in enumerate(batch.samples)}
        parallel = DataParallel(rank=rank, size=2, group=None)
        share = own_shard(batch, parallel)
        add_advantages(config.policy, share, parallel, custom=hook)
        torch.save({ids[id(s)]: s.advantages for s in share.samples}, out_dir / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.integration
def test_the_hook_groups_are_rank_local_and_its_whitening_spans_the_ranks(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_hook_on_rank, args=(rendezvous_file(), tmp_path), nprocs=2, join=True)
    config, hook = _hook("reward_plus_position", normalize_advantages=True)
    whole = _shard()
    add_advantages(config.policy, whole, SINGLE, custom=hook)
    sharded = {**torch.load(tmp_path / "rank0.pt"), **torch.load(tmp_path / "rank1.pt")}
    assert sorted(sharded) == list(range(len(whole.samples)))
    for index, sample in enumerate(whole.samples):
        torch.testing.assert_close(sharded[index], sample.advantages, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# The convert hook, on hand-built wire samples


def _wire(index: int, *, status: str = "completed", versions: tuple[int, ...] = (4, 3, 5)) -> Sample:
    n = len(versions)
    return Sample(sample_id=f"g/{index}", group_id="g", index=index, prompt="p", prompt_tokens=2,
                  tokens=np.arange(10, 12 + n, dtype=np.int32), response_length=n, reward=float(index),
                  loss_mask=np.ones(n, dtype=np.int8), rollout_log_probs=np.full(n, -0.5, dtype=np.float32),
                  token_versions=np.asarray(versions, dtype=np.int32), status=status,  # type: ignore[arg-type]
                  metadata={"data_index": 7})


def _convert(plugin: str):
    return load_convert_samples(build_config({"custom_convert_samples_to_train_data_path": plugin}))


@pytest.mark.unit
def test_both_slime_batch_hooks_declare_their_rewards_final() -> None:
    """slime trains on what its conversion or reward post-process returns, without its group normalisation: the
    adapters say so, and the learner reads it (the effect: the trainer test below)."""
    from actors.extensions.load import batch_rewrite

    post_process = batch_rewrite(build_config({"custom_reward_post_process_path": f"{HERE}:never_called"}))
    assert _convert(f"{HERE}:drops_the_last_sample").rewards_as_given
    assert post_process is not None and post_process.rewards_as_given
    assert batch_rewrite(build_config({})) is None


@pytest.mark.unit
def test_the_convert_hook_must_return_one_entry_per_sample() -> None:
    convert = _convert(f"{HERE}:drops_the_last_sample")
    with pytest.raises(ValueError, match=rf"--custom-convert-samples-to-train-data-path '{HERE}:drops_the_last_"
                                         r"sample': 'tokens' has 2 entries for 3 input samples"):
        convert([_wire(i) for i in range(3)])


@pytest.mark.unit
def test_a_changed_response_without_log_probs_is_an_error() -> None:
    convert = _convert(f"{HERE}:cuts_the_response_to_one_token")
    with pytest.raises(ValueError, match=r"sample 0 \(g/0\): the function changed the sample's tokens "
                                         r"\(response_length 3 -> 1\) but gave no rollout_log_probs"):
        convert([_wire(0)])


@pytest.mark.unit
def test_a_changed_response_takes_the_oldest_version_and_the_given_log_probs() -> None:
    [out] = _convert(f"{HERE}:cuts_with_log_probs")([_wire(0, versions=(4, 3, 5))])
    assert (out.response_length, out.prompt_tokens, out.tokens.tolist()) == (1, 2, [10, 11, 12])
    assert out.token_versions.tolist() == [3]
    assert out.rollout_log_probs.tolist() == [-0.25]
    assert out.reward == 1.0


@pytest.mark.unit
def test_the_example_conversion_trains_nothing_of_a_truncated_sample() -> None:
    samples = [_wire(0), _wire(1, status="truncated"), _wire(2), _wire(3, status="truncated")]
    out = _convert("examples.slime_style.train_data:skip_truncated")(samples)
    assert [s.loss_mask.tolist() for s in out] == [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert [s.reward for s in out] == [-1.5, -0.5, 0.5, 1.5]  # centred on the group mean, truncated ones included
    for before, after in zip(samples, out, strict=True):  # tokens unchanged: versions and log-probs kept
        assert np.array_equal(after.token_versions, before.token_versions)
        assert np.array_equal(after.rollout_log_probs, before.rollout_log_probs)
    assert SlimeSample.Status("truncated") == SlimeSample.Status.TRUNCATED


# ----------------------------------------------------------------------------------------------------------------
# Both hooks through a real TrainingStep with the torch trainer on a tiny model


@pytest.fixture(scope="module")
def engine_samples(tiny_model_path: Path) -> list[Sample]:
    config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 4,
                           "rollout_max_response_len": 5})
    samples = generate(tiny_model_path, config, groups(4))
    return [msgspec.structs.replace(s, reward=float(i % 2)) for i, s in enumerate(samples)]


def _flags(model: Path, **flags: Any) -> dict[str, Any]:
    return {"hf_checkpoint": str(model), "rollout_batch_size": 3, "n_samples_per_prompt": 4, "lr": 1e-2, **flags}


@pytest.mark.integration
def test_the_trainer_sees_the_loss_masks_and_rewards_of_a_convert_hook(tiny_model_path: Path,
                                                                      engine_samples: list[Sample]) -> None:
    trainer = _trainer(tiny_model_path)
    config = build_config(_flags(tiny_model_path,
                                 custom_convert_samples_to_train_data_path=f"{HERE}:mask_first_token_reward_by_index",
                                 custom_reward_post_process_path=f"{HERE}:never_called"))
    report = TrainingStep(trainer, config).train(engine_samples, [0] * len(engine_samples))
    assert not report.result.skipped
    [(seen, _ends)] = trainer.steps
    assert len(seen) == len(engine_samples)
    for wire, sample in zip(engine_samples, seen, strict=True):
        assert sample.loss_mask.tolist() == [0.0] + [1.0] * (wire.response_length - 1)
        assert sample.reward == wire.index - 1.5
        # grpo without its group normalisation: the hook's reward on every trained token, as slime trains it.
        assert sample.advantages.tolist() == pytest.approx((sample.reward * sample.loss_mask).tolist())
    assert report.metrics["rollout/post_processed_reward_mean"] == pytest.approx(0.0)


@pytest.mark.integration
def test_the_trainer_trains_on_the_advantage_hook_output(tiny_model_path: Path,
                                                         engine_samples: list[Sample]) -> None:
    trainer = _trainer(tiny_model_path)
    SEEN.clear()
    config = build_config(_flags(tiny_model_path, custom_advantage_function_path=f"{HERE}:reward_plus_position",
                                 disable_rewards_normalization=True))
    TrainingStep(trainer, config).train(engine_samples, [0] * len(engine_samples))
    [(seen, _ends)] = trainer.steps
    assert SEEN["data"]["rewards"] == [s.reward for s in engine_samples]
    for wire, sample in zip(engine_samples, seen, strict=True):
        expected = _by_plugin(wire.reward, wire.response_length) * torch.as_tensor(wire.loss_mask, dtype=torch.float32)
        assert torch.equal(sample.advantages, expected)
