"""One learner step on a rollout batch: a short pipeline of named stages, then one or more optimizer steps.

to typed batch -> this rank's shard -> reference log-probs (when the policy needs them) -> teacher log-probs
(distillation) -> pi_old (when it differs from the training forward) -> advantages -> per optimizer step: its
mini-batch, its loss with that step's global denominators, the trainer's step. The stages live in
`actors.learner.stages`, the loss in `policies.step_loss`; the trainer gets the batch and the loss object and
never calls back into the learner. Kept apart from the learner actor so it runs (and is tested) without any
socket.

Several optimizer steps per batch (`--num-steps-per-rollout N`, or `--global-batch-size` = batch / N), as slime:
reference log-probs, pi_old and advantages are computed ONCE for the whole batch, before the first step (so
pi_old is the policy before the batch's first update, never an intermediate one); each step then trains its
mini-batch with its own denominators. The policy version advances once per batch (`VersionCounter` in
`engines.training.base`). The batch's row in train.jsonl keeps its metric names, as aggregates over the steps
(`combine_steps`), and adds `step_{k}/loss`, `step_{k}/lr`, `step_{k}/grad_norm` for each step k = 1..N.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from actors.config import RunConfig
from actors.config.teachers import run_teachers, teacher_of
from actors.extensions.load import (
    advantage_function,
    batch_rewrite,
    pg_loss_reducer,
    policy_loss,
    rollout_data_postprocess,
)
from actors.learner import stages
from actors.learner.episode_metrics import episode_metrics
from actors.learner.profiling import StepProfiler, profile_directory, step_part
from actors.learner.train_dump import write_train_data
from bus.episodes import final_segments
from bus.schema import Sample
from engines.training.base import DataParallel, StepResult, Trainer
from engines.vision.processor import VisionProcessor
from policies.rewards import REWARD_EXTRAS, extras_means
from policies.staleness import staleness_histogram
from policies.step_loss import PiOldSource, pi_old_source, zero_advantage_is_zero_gradient


@dataclass
class StepReport:
    """`metrics`: everything the step says about the batch; `rollout`: those of them that are about generation
    (`TrainingStep.prepare`'s), which a slime rollout log hook may ask to leave out."""

    result: StepResult
    metrics: dict[str, float]
    rollout: dict[str, float] = field(default_factory=dict)


@dataclass
class PreparedBatch:
    """A batch after the stages that do not read the policy being trained, so they may run while the previous
    batch trains: the typed (and sharded) samples with their reference log-probs, and the rollout metrics."""

    batch: stages.StepBatch
    metrics: dict[str, float]


# --use-rollout-routing-replay: samples of the batch without the engine's routes (the batch then trains unreplayed)
ROUTELESS_SAMPLES = "routing_replay/samples_without_routes"


class TrainingStep:
    def __init__(self, trainer: Trainer, config: RunConfig, *, pi_old: PiOldSource | None = None) -> None:
        """`pi_old` overrides the rule (`policies.step_loss.pi_old_source`); only tests comparing paths set it."""
        self.trainer = trainer
        self.policy = config.policy
        # Every loss but SFT's trains on rewards (through the advantages); SFT learns the labels and reads none.
        self.trains_on_rewards = self.policy.loss_type != "sft"
        # slime's --disable-compute-advantages-and-returns: zeros, for a hook or a custom loss to do with as it means
        self.computes_advantages = not config.learner.disable_compute_advantages_and_returns
        self.rewrite_batch = batch_rewrite(config)
        self.custom_advantages = advantage_function(config)
        self.postprocess = rollout_data_postprocess(config)
        self.loss_fn = policy_loss(config)
        self.pg_reducer = pg_loss_reducer(config)
        if self.rewrite_batch is not None and self.rewrite_batch.rewards_as_given:  # as the rewrite declares
            self.policy = self.policy.model_copy(update={"rewards_normalization": False})
        # Greedy rollouts report log-probs at temperature 1 (the engine's convention); match them.
        self.temperature = config.rollout.rollout_temperature or 1.0
        self.steps = config.optimizer_steps_per_batch
        self.newest_version_only = config.learner.mask_offpolicy_in_partial_rollout
        self.rollout_routes = config.trainer.use_rollout_routing_replay
        self.pi_old = pi_old or pi_old_source(self.policy, decoupled=config.learner.use_decoupled_ppo,
                                              steps_per_batch=self.steps)
        self.skip_gradient_free = (config.learner.skip_zero_advantage_samples  # MTP layers learn from every sample
                                   and zero_advantage_is_zero_gradient(self.policy)
                                   and not config.megatron.enable_mtp_training)
        self.teachers = run_teachers(config.distillation) if self.policy.use_opd else {}
        self.teacher_key = config.distillation.opd_teacher_key
        self.critic_only_steps = config.learner.num_critic_only_steps
        self.rollout_entropy = config.learner.use_rollout_entropy
        if self.pi_old == "training_forward" and self.steps > 1:
            raise ValueError(f"pi_old from the training forward needs one optimizer step per batch, not {self.steps}")
        self.reset_optimizer = config.trainer.reset_optimizer_states
        self.images = images_of(config)  # a vision-language model's image processor, made once
        self.ref_update_interval = config.trainer.ref_update_interval
        # --use-pytorch-profiler / --record-memory-history, and --save-debug-train-data: per rank, per step
        self.profiler = StepProfiler.for_run(config.profiling, profile_directory(config.profiling, Path(".")))
        dump = config.learner.save_debug_train_data
        self.train_dump_dir = Path(dump).expanduser() if dump else None
        _check_supported(trainer, "reset_optimizer_state", "--reset-optimizer-states", self.reset_optimizer)
        _check_supported(trainer, "refresh_reference", "--ref-update-interval", self.ref_update_interval is not None)

    @property
    def refreshes_reference(self) -> bool:
        """Whether the reference changes during the run: its log-probs of a batch are then taken after the
        previous batch's refresh, never beside that batch's training (`Trainer.prepares_beside_training`)."""
        return self.ref_update_interval is not None

    def train(self, samples: Sequence[Sample], staleness: Sequence[int], *, shard: bool = True,
              rollout_id: int | None = None) -> StepReport:
        """Every learner rank calls this; a data-parallel rank trains its share of the groups: cut here from the
        whole batch, or already cut at rank 0 (`shard=False`, and the rollout metrics are then the share's).
        `rollout_id` (the batch's 0-based id) names the step for the profiler and the train-data dump."""
        with self._step(rollout_id):
            return self._train_prepared(self.prepare(samples, staleness, shard=shard), rollout_id)

    def train_prepared(self, prepared: PreparedBatch, *, rollout_id: int | None = None) -> StepReport:
        """The stages that read the policy as it is now (pi_old, advantages), then the optimizer steps."""
        with self._step(rollout_id):
            return self._train_prepared(prepared, rollout_id)

    def _step(self, rollout_id: int | None) -> contextlib.AbstractContextManager[None]:
        return self.profiler.step(rollout_id) if self.profiler is not None else contextlib.nullcontext()

    def prepare(self, samples: Sequence[Sample], staleness: Sequence[int], *, shard: bool = True) -> PreparedBatch:
        """The stages that read only the batch and the frozen reference model. A one-rank learner runs this for
        the next batch while the current one trains (`Trainer.prepares_beside_training`)."""
        batch_metrics = rollout_metrics(samples, staleness)
        if self.rewrite_batch is not None:  # on the whole batch (each rank alike), before any cut
            samples = self.rewrite_batch(list(samples))
            # the hooks give every sample a reward (`actors.slime_compat`), so none is missing here
            batch_metrics["rollout/post_processed_reward_mean"] = float(np.mean([s.reward for s in samples]))
        arrived = len(samples)
        samples, vision = stages.with_usable_images(samples, self.images)
        if len(samples) < arrived or self.images is not None:
            batch_metrics[stages.BAD_IMAGE_SAMPLES] = float(arrived - len(samples))
        batch = stages.to_step_batch(samples, rewarded=self.trains_on_rewards,
                                     newest_version_only=self.newest_version_only,
                                     teacher_of=self._teacher_name if self.teachers else None, vision=vision)
        if self.newest_version_only:
            batch_metrics["partial/masked_older_tokens"] = float(stages.masked_older_tokens(samples))
        if self.rollout_routes:
            batch_metrics[ROUTELESS_SAMPLES] = float(stages.unreplayable_routes(batch))
        if shard:
            batch = stages.own_shard(batch, self.trainer.data_parallel())
        if self.policy.needs_ref:
            with step_part(self.profiler, "train_log_probs"):
                stages.add_ref_log_probs(self.trainer, batch, temperature=self.temperature)
        if self.teachers:
            held = {name for name, teacher in self.teachers.items() if teacher.in_learner}
            with step_part(self.profiler, "train_log_probs"):
                stages.add_teacher_log_probs(self.trainer, batch, held, temperature=self.temperature)
        return PreparedBatch(batch=batch, metrics=batch_metrics)

    def _train_prepared(self, prepared: PreparedBatch, rollout_id: int | None) -> StepReport:
        batch, parallel = prepared.batch, self.trainer.data_parallel()
        critic = self.trainer.has_critic
        if self.pi_old == "separate_forward" or self.rollout_entropy:
            with step_part(self.profiler, "train_log_probs"):
                stages.add_old_log_probs(self.trainer, batch, temperature=self.temperature,
                                         as_pi_old=self.pi_old == "separate_forward",
                                         with_entropy=self.rollout_entropy)
        if critic:
            stages.add_values(self.trainer, batch)
        # slime's --num-critic-only-steps: the first N batches train the critic alone (counted in critic updates,
        # which a checkpoint keeps, so a resumed run goes on where it was).
        warming_up = critic and self.trainer.critic_steps < self.critic_only_steps * self.steps
        advantage_metrics = {}
        if self.trains_on_rewards and self.computes_advantages:
            advantage_metrics = stages.add_advantages(self.policy, batch, parallel, custom=self.custom_advantages)
        elif self.trains_on_rewards:
            for sample in batch.samples:
                sample.advantages = torch.zeros(sample.response_length)
        if self.postprocess is not None:  # slime's hook: it may change the loss masks and advantages
            self.postprocess(self.policy, batch.samples, batch.group_index(), self.trainer.version)
        if self.train_dump_dir is not None and rollout_id is not None:  # what the optimizer steps train on
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            write_train_data(self.train_dump_dir, rollout_id=rollout_id, rank=rank, parallel=parallel,
                             version=self.trainer.version, samples=batch.samples, group_ids=batch.group_ids)
        parts = stages.mini_batches(batch, self.steps, parallel)
        if self.reset_optimizer:  # slime: each rollout's optimizer steps start from a never-stepped Adam
            self.trainer.reset_optimizer_state()
        version = self.trainer.version
        results = []
        for index, part in enumerate(parts):
            critic_metrics = self._critic_step(part, parallel) if critic else {}
            result = (self._warm_up_result() if warming_up
                      else self._optimizer_step(part, parallel, last=index == len(parts) - 1))
            result.metrics.update(critic_metrics)
            results.append(result)
        result = combine_steps(results)
        if self._refreshes_after(version):
            self.trainer.refresh_reference()
            result.metrics["ref/refreshed"] = 1.0
        rollout = {**prepared.metrics, **stages.rollout_entropy_metric(batch)}
        return StepReport(result=result, metrics={**result.metrics, **rollout, **advantage_metrics}, rollout=rollout)

    def _refreshes_after(self, version: int) -> bool:
        """slime refreshes the reference after rollouts N, 2N, ... have trained; counted in versions here (batches
        that applied an update, restored from a checkpoint), so a resumed run keeps the rhythm."""
        now = self.trainer.version
        return self.ref_update_interval is not None and now != version and now % self.ref_update_interval == 0

    def _teacher_name(self, sample: Sample) -> str:
        return teacher_of(sample.metadata, self.teachers, self.teacher_key).name

    def _critic_step(self, part: stages.StepBatch, parallel: DataParallel) -> dict[str, float]:
        """One critic update on this optimizer step's samples (before the policy's, as slime orders them)."""
        result = self.trainer.train_critic(part.samples, stages.build_value_loss(self.policy, part, parallel))
        metrics = {f"critic/{name}": value for name, value in result.metrics.items()}
        metrics["critic/skipped"] = float(result.skipped)
        return metrics

    def _warm_up_result(self) -> StepResult:
        """A policy step not taken: the batch trained the critic only; the version stays where it is."""
        return StepResult(version=self.trainer.version, metrics={"critic_only": 1.0}, grad_norm=0.0, skipped=True,
                          skip_reason=CRITIC_ONLY_REASON)

    def _optimizer_step(self, part: stages.StepBatch, parallel: DataParallel, *, last: bool) -> StepResult:
        trained = stages.with_gradient(part) if self.skip_gradient_free else part
        loss = stages.build_loss(self.policy, part, parallel, pi_old_from_forward=self.pi_old == "training_forward",
                                 trained=trained if trained is not part else None, loss_fn=self.loss_fn,
                                 pg_reducer=self.pg_reducer)
        # `ends_batch` only with several steps: a trainer written for one step per batch need not know it.
        extra = {} if self.steps == 1 else {"ends_batch": last}
        with step_part(self.profiler, "train_actor"):
            result = self.trainer.train_step(trained.samples, loss, temperature=self.temperature,
                                             with_entropy=loss.needs_entropy, **extra)
        result.metrics["zero_advantage_skipped"] = float(len(part.samples) - len(trained.samples))
        return result


def images_of(config: RunConfig) -> VisionProcessor | None:
    """The image side of the run's model when its folder holds a vision-language model (None for a text model,
    or a model the learner does not load from a local folder)."""
    path = config.model.hf_checkpoint
    if path is None or not (Path(path).expanduser() / "config.json").is_file():
        return None
    return VisionProcessor.from_model_folder(Path(path).expanduser())


def _check_supported(trainer: Trainer, method: str, flag: str, wanted: bool) -> None:
    """A trainer that keeps `Trainer`'s refusing default for `method` is refused at start-up, not at the first
    batch that needs it."""
    if wanted and getattr(type(trainer), method, None) is getattr(Trainer, method):
        raise ValueError(f"{flag}: the {type(trainer).__name__} trainer does not implement Trainer.{method}")


CRITIC_ONLY_REASON = "critic-only warm-up (--num-critic-only-steps): the policy is not trained yet"

# Metrics of a step that are totals of its work; the batch's value is their sum over steps, others are means.
_SUMMED_METRICS = ("loss_tokens", "sequences", "micro_batches", "step_seconds")
_PER_STEP_METRICS = ("loss", "lr", "grad_norm")


def combine_steps(results: Sequence[StepResult]) -> StepResult:
    """One batch's result from its optimizer steps' (the one step's own result when there is one).

    Same metric names as one step: totals summed, everything else (loss, lr, grad_norm, the loss's diagnostics,
    each already a per-step mean) averaged over the steps; plus each step's loss, lr and grad norm. `skipped`
    means no step of the batch applied an update (the version did not move); a partial skip is counted in
    `skipped_steps` and explained in `skip_reason`.
    """
    if len(results) == 1:
        return results[0]
    metrics: dict[str, float] = {}
    for key in dict.fromkeys(key for result in results for key in result.metrics):
        values = [result.metrics[key] for result in results if key in result.metrics]
        metrics[key] = float(np.sum(values)) if key in _SUMMED_METRICS else float(np.mean(values))
    for index, result in enumerate(results, start=1):
        for key in _PER_STEP_METRICS:
            metrics[f"step_{index}/{key}"] = result.metrics.get(key, float("nan"))
    skipped = [index for index, result in enumerate(results, start=1) if result.skipped]
    metrics["optimizer_steps"] = float(len(results))
    metrics["skipped_steps"] = float(len(skipped))
    reasons = "; ".join(f"step {index}: {results[index - 1].skip_reason}" for index in skipped)
    return StepResult(version=results[-1].version, metrics=metrics,
                      grad_norm=float(np.mean([result.grad_norm for result in results])),
                      skipped=len(skipped) == len(results), skip_reason=reasons or None)


def rollout_metrics(samples: Sequence[Sample], staleness: Sequence[int]) -> dict[str, float]:
    """What the batch says about generation: reward, accuracy, truncation and the mean of each extra field the
    reward function returned (`reward/format_ok`, ...) per episode (an agent's episode of several segments counts
    once, by its final segment), lengths per sample, staleness. The reward metrics are NaN for a batch without
    rewards: SFT samples that no reward worker scored (the buffer serves only rewarded ones)."""
    finals = final_segments(samples)
    rewards = np.asarray([s.reward for s in finals if s.reward is not None], dtype=np.float64)
    lengths = np.asarray([s.response_length for s in samples])
    metrics = {
        "rollout/reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
        "rollout/reward_std": float(rewards.std()) if len(rewards) else float("nan"),
        "rollout/accuracy": float((rewards >= 1.0).mean()) if len(rewards) else float("nan"),
        "rollout/response_length_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "rollout/truncated_fraction": float(np.mean([s.status == "truncated" for s in finals])) if finals else 0.0,
        "rollout/samples": float(len(samples)),
        "rollout/tokens": float(lengths.sum()),
    }
    metrics |= episode_metrics(samples)
    extras = extras_means(sample.metadata[REWARD_EXTRAS] for sample in finals
                          if isinstance(sample.metadata.get(REWARD_EXTRAS), dict))
    metrics |= {f"reward/{name}": value for name, value in extras.items()}
    if staleness:
        values = np.asarray(staleness)
        metrics["staleness/max"] = float(values.max())
        metrics["staleness/mean"] = float(values.mean())
        for value, count in staleness_histogram(list(staleness)).items():
            metrics[f"staleness/hist_{value}"] = float(count)
    return metrics
