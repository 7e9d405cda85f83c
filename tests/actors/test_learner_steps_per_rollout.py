"""Several optimizer steps per rollout batch (`--global-batch-size` below the batch, `--num-steps-per-rollout`):
pi_old and advantages once per batch, one version per batch, and nothing extra with one step per batch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.config import build_config
from actors.learner.stages import StepBatch, mini_batches
from actors.learner.step import TrainingStep, combine_steps
from bus.schema import Sample
from engines.training.base import DataParallel, Loss, StepResult, TrainSample, VersionCounter
from engines.training.config import TorchTrainerConfig
from policies.config import PolicyLossConfig
from policies.step_loss import pi_old_source
from tests.actors.test_learner_step import CountingTrainer, generate, groups, weights
from tests.support.rendezvous import rendezvous_file


class RecordingTrainer(CountingTrainer):
    """The real trainer, also recording each optimizer step's samples (as handed in) and whether it ends the batch."""

    def __init__(self, config: TorchTrainerConfig) -> None:
        super().__init__(config)
        self.steps: list[tuple[list[TrainSample], bool]] = []

    def train_step(self, samples: Sequence[TrainSample], loss: Loss, *, temperature: float,
                   with_entropy: bool = False, ends_batch: bool = True) -> StepResult:
        self.steps.append(([TrainSample(**vars(s)) for s in samples], ends_batch))
        return super().train_step(samples, loss, temperature=temperature, with_entropy=with_entropy,
                                  ends_batch=ends_batch)


def _config(model: Path, **flags: object):
    return build_config({"hf_checkpoint": str(model), "rollout_batch_size": 3, "n_samples_per_prompt": 4,
                         "lr": 1e-2, **flags})


def _trainer(model: Path) -> RecordingTrainer:
    return RecordingTrainer(TorchTrainerConfig(model_path=model, lr=1e-2, eps=1.0, check_packing=False))


@pytest.fixture(scope="module")
def batch(tiny_model_path: Path) -> list[Sample]:
    """One rollout batch of 3 groups x 4 samples from the real engine, with mixed rewards."""
    samples = generate(tiny_model_path, _config(tiny_model_path, rollout_max_response_len=5), groups(4))
    return [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "reward": float(i % 3 == 0)})
            for i, s in enumerate(samples)]


@pytest.mark.integration
def test_half_the_batch_per_step_takes_two_steps_and_one_version(tiny_model_path: Path, batch: list[Sample]) -> None:
    two = _trainer(tiny_model_path)
    report = TrainingStep(two, _config(tiny_model_path, global_batch_size=6)).train(batch, [0] * len(batch))
    assert [(len(samples), ends) for samples, ends in two.steps] == [(6, False), (6, True)]
    assert two.version == 1, "the version counts rollout batches, not optimizer steps"
    assert report.result.version == 1 and not report.result.skipped
    assert report.metrics["optimizer_steps"] == 2 and report.metrics["sequences"] == 12
    assert {"step_1/lr", "step_2/lr", "step_1/grad_norm", "step_2/loss"} <= set(report.metrics)

    one = _trainer(tiny_model_path)
    TrainingStep(one, _config(tiny_model_path)).train(batch, [0] * len(batch))
    assert len(one.steps) == 1 and one.version == 1
    two_weights, one_weights = weights(two), weights(one)
    assert any(not torch.allclose(two_weights[name], one_weights[name], atol=1e-6) for name in one_weights)


@pytest.mark.integration
def test_pi_old_of_every_step_is_the_policy_before_the_first_step(tiny_model_path: Path, batch: list[Sample]) -> None:
    trainer = _trainer(tiny_model_path)
    config = _config(tiny_model_path, num_steps_per_rollout=2)  # tis by default: pi_old is the learner's
    before = _trainer(tiny_model_path)  # same weights as `trainer` before its first step
    TrainingStep(trainer, config).train(batch, [0] * len(batch))
    assert trainer.forwards == ["policy"], "pi_old is computed once per batch"
    second = trainer.steps[1][0]
    pi_old = torch.cat([s.old_log_probs for s in second])
    initial = before.compute_log_probs(second, temperature=1.0).log_probs
    updated = trainer.compute_log_probs(second, temperature=1.0).log_probs
    torch.testing.assert_close(pi_old, initial, atol=1e-6, rtol=0)
    assert (pi_old - updated).abs().max() > 1e-4, "step 2's pi_old must not be the updated policy's"


@pytest.mark.integration
@pytest.mark.parametrize("flags", [{}, {"global_batch_size": 12}, {"num_steps_per_rollout": 1}],
                         ids=["unset", "global-batch-size", "num-steps"])
def test_one_step_per_batch_reuses_the_training_forward(tiny_model_path: Path, batch: list[Sample],
                                                        flags: dict) -> None:
    trainer = _trainer(tiny_model_path)
    step = TrainingStep(trainer, _config(tiny_model_path, **flags))
    report = step.train(batch, [0] * len(batch))
    assert step.pi_old == "training_forward"
    assert trainer.forwards == [], "no no-grad forward besides the training step's"
    assert [len(samples) for samples, _ in trainer.steps] == [12]
    assert "optimizer_steps" not in report.metrics and "step_1/lr" not in report.metrics


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "message"), [
    ({"num_steps_per_rollout": 5}, "num_steps_per_rollout 5 must divide rollout_batch_size x n_samples_per_prompt"),
    ({"global_batch_size": 5}, "global_batch_size 5 must divide rollout_batch_size x n_samples_per_prompt = 12"),
    ({"global_batch_size": 24}, "global_batch_size 24 must divide"),
    ({"global_batch_size": 6, "num_steps_per_rollout": 3}, "global_batch_size 6 disagrees with num_steps_per_rollout"),
])
def test_batch_splits_that_do_not_fit_are_refused_naming_the_flags(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config({"rollout_batch_size": 3, "n_samples_per_prompt": 4, **flags})


@pytest.mark.unit
def test_steps_per_batch_follow_slimes_rule() -> None:
    def steps(**flags: object) -> int:
        return build_config({"rollout_batch_size": 3, "n_samples_per_prompt": 4, **flags}).optimizer_steps_per_batch

    assert steps() == 1
    assert steps(global_batch_size=12) == 1
    assert steps(global_batch_size=4) == 3
    assert steps(num_steps_per_rollout=4) == 4
    assert steps(num_steps_per_rollout=2, global_batch_size=6) == 2  # agreeing flags are accepted


@pytest.mark.unit
def test_several_steps_need_pi_old_before_the_first_step() -> None:
    tis = PolicyLossConfig(off_policy_correction="tis")
    assert pi_old_source(tis, decoupled=False) == "training_forward"
    assert pi_old_source(tis, decoupled=False, steps_per_batch=2) == "separate_forward"
    no_correction = PolicyLossConfig(off_policy_correction="none")
    assert pi_old_source(no_correction, decoupled=False, steps_per_batch=2) == "rollout"  # mu does not move


@pytest.mark.unit
def test_mini_batches_cut_the_batch_in_order_and_refuse_too_few_samples() -> None:
    samples = [TrainSample(torch.arange(4), 2) for _ in range(7)]
    batch = StepBatch(samples=samples, group_ids=[f"g{i // 2}" for i in range(7)])
    parts = mini_batches(batch, 3, DataParallel(rank=0, size=1))
    assert [len(part.samples) for part in parts] == [2, 2, 3]
    assert [s for part in parts for s in part.samples] == samples
    assert [g for part in parts for g in part.group_ids] == batch.group_ids
    assert mini_batches(batch, 1, DataParallel(rank=0, size=1)) == [batch]
    with pytest.raises(ValueError, match="7 samples cannot make 8 optimizer steps"):
        mini_batches(batch, 8, DataParallel(rank=0, size=1))


@pytest.mark.unit
def test_the_version_moves_once_per_batch_and_the_schedule_per_applied_step() -> None:
    counter = VersionCounter()
    counter.after_step(applied=True, ends_batch=False)
    assert (counter.version, counter.optimizer_steps) == (0, 1)
    counter.after_step(applied=False, ends_batch=True)  # a skipped last step: the first one still moved the weights
    assert (counter.version, counter.optimizer_steps) == (1, 1)
    counter.after_step(applied=False, ends_batch=False)
    counter.after_step(applied=False, ends_batch=True)  # nothing applied: the weights are those of version 1
    assert counter.state() == {"version": 1, "optimizer_steps": 1}
    counter.restore({"version": 5})  # a checkpoint from before steps were counted apart
    assert (counter.version, counter.optimizer_steps) == (5, 5)


@pytest.mark.unit
def test_combined_steps_keep_the_metric_names_with_sums_and_means() -> None:
    def result(loss: float, lr: float, *, skipped: bool = False) -> StepResult:
        metrics = {"loss": loss, "lr": lr, "grad_norm": 2 * loss, "loss_tokens": 10.0, "clipfrac": loss / 10}
        return StepResult(version=3, metrics=metrics, grad_norm=2 * loss, skipped=skipped,
                          skip_reason="non-finite loss (nan)" if skipped else None)

    single = result(1.0, 0.1)
    assert combine_steps([single]) is single
    combined = combine_steps([result(1.0, 0.1), result(3.0, 0.2, skipped=True)])
    assert combined.metrics["loss"] == 2.0 and combined.metrics["loss_tokens"] == 20.0
    assert combined.metrics["clipfrac"] == pytest.approx(0.2)
    assert combined.metrics["step_2/lr"] == 0.2 and combined.metrics["step_1/grad_norm"] == 2.0
    assert combined.metrics["skipped_steps"] == 1.0 and not combined.skipped
    assert combined.skip_reason == "step 2: non-finite loss (nan)" and combined.version == 3


def _synthetic_batch() -> list[Sample]:
    """4 groups x 2 samples of random tokens, with engine log-probs so the default TIS correction has its mu.

    Group g0 is long, so data-parallel rank 0 gets it alone (2 samples) and rank 1 the other three (6)."""
    generator = np.random.default_rng(7)
    samples = []
    for index in range(8):
        response = 20 if index < 2 else 2 + index % 3
        tokens = generator.integers(6, 100, size=4 + response).astype(np.int32)
        samples.append(Sample(sample_id=f"g{index // 2}/{index % 2}", group_id=f"g{index // 2}", index=index % 2,
                              prompt="p", prompt_tokens=4, tokens=tokens, response_length=response,
                              reward=float(index % 2), rollout_log_probs=np.full(response, -4.0, np.float32),
                              status="completed"))
    return samples


def _data_parallel_rank(rank: int, rendezvous: str, model: Path, out_dir: Path) -> None:
    """Both cases of the test on one world (a fresh trainer each): 2 optimizer steps per batch, then 4."""
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    try:
        for steps in (2, 4):
            trainer = _trainer(model)
            try:
                config = build_config({"hf_checkpoint": str(model), "rollout_batch_size": 4,
                                       "n_samples_per_prompt": 2, "num_steps_per_rollout": steps})
                try:
                    TrainingStep(trainer, config).train(_synthetic_batch(), [0] * 8)
                    outcome = {"steps": [len(s) for s, _ in trainer.steps], "version": trainer.version,
                               "weights": weights(trainer)}
                except ValueError as error:
                    outcome = {"error": str(error)}
                torch.save(outcome, out_dir / f"{steps}-rank{rank}.pt")
            finally:
                trainer.close()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_data_parallel_ranks_take_the_same_steps_or_fail_together(tiny_model_path: Path, tmp_path: Path) -> None:
    """Each rank cuts its own shard; a shard too small for the steps fails every rank, none waits in a collective."""
    torch.multiprocessing.spawn(_data_parallel_rank, args=(rendezvous_file(), tiny_model_path, tmp_path),
                                nprocs=2, join=True)
    for steps in (2, 4):
        ranks = [torch.load(tmp_path / f"{steps}-rank{rank}.pt") for rank in range(2)]
        if steps == 4:  # rank 1 alone could take 4 steps: without agreeing it would wait for rank 0 forever
            assert all("2 samples on some data-parallel rank (of 2) cannot make 4 optimizer steps" in outcome["error"]
                       for outcome in ranks)
            continue
        assert [outcome["version"] for outcome in ranks] == [1, 1]
        assert [outcome["steps"] for outcome in ranks] == [[1, 1], [3, 3]]
        assert sum(sum(outcome["steps"]) for outcome in ranks) == 8
        for name, tensor in ranks[0]["weights"].items():
            torch.testing.assert_close(ranks[1]["weights"][name], tensor, atol=0, rtol=0)
