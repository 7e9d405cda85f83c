"""The stages of one learner step before the trainer, each a small function on a `StepBatch`.

to typed batch -> this rank's shard -> reference log-probs -> pi_old -> advantages (once per rollout batch) ->
mini-batches (one per optimizer step) -> loss (each mini-batch's denominators); the step
(`actors.learner.step`) chains them and hands the trainer each mini-batch and its loss. Each stage fills typed
fields of the `TrainSample`s; none of them runs the optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch

from actors.extensions.points import AdvantageFunction, PolicyLossFunction
from bus.episodes import episode_id
from bus.schema import Sample
from engines.training.base import DataParallel, Trainer, TrainSample, teacher_role
from engines.vision.processor import VisionInputs, VisionProcessor
from policies.advantages import GradedSteps, compute_advantages
from policies.config import PolicyLossConfig
from policies.distillation import reverse_kl_means
from policies.losses import PgReducer
from policies.step_loss import (
    PolicyLoss,
    ValueLoss,
    explained_variance,
    step_denominators,
    value_denominators,
)

logger = logging.getLogger(__name__)

# The batch metric counting samples dropped because the learner could not use their images.
BAD_IMAGE_SAMPLES = "dropped/bad_images"


@dataclass
class StepBatch:
    """This rank's samples in the trainer's types, with what the stages need beside them (group and episode ids)."""

    samples: list[TrainSample]
    group_ids: list[str]
    teachers: list[str] = field(default_factory=list)  # each sample's distillation teacher; empty without one
    episode_ids: list[str] = field(default_factory=list)  # each sample's episode (`bus.episodes`); empty: its own

    def take(self, indices: Sequence[int]) -> StepBatch:
        """The samples at `indices`, in that order, with their group and episode ids and teachers."""
        indices = list(indices)
        return StepBatch(samples=[self.samples[i] for i in indices], group_ids=[self.group_ids[i] for i in indices],
                         teachers=[self.teachers[i] for i in indices] if self.teachers else [],
                         episode_ids=[self.episode_ids[i] for i in indices] if self.episode_ids else [])

    @property
    def episodes(self) -> list[list[int]]:
        """The samples' indices per episode, episodes in the order they start (a segment is a sample; an
        episode's segments travel together in a batch)."""
        members: dict[str, list[int]] = {}
        for index, episode in enumerate(self.episode_ids or map(str, range(len(self.samples)))):
            members.setdefault(episode, []).append(index)
        return list(members.values())

    @property
    def lengths(self) -> list[int]:
        return [s.response_length for s in self.samples]

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.long)

    def packed(self, name: str) -> torch.Tensor | None:
        """One per-token field concatenated over the samples; None when the samples do not carry it."""
        values = [getattr(s, name) for s in self.samples]
        if not values or any(v is None for v in values):
            return None
        return torch.cat(values)

    def group_index(self) -> torch.Tensor:
        """Each sample's group as a number (`[B]` long, in order of first appearance)."""
        index: dict[str, int] = {}
        return torch.tensor([index.setdefault(g, len(index)) for g in self.group_ids], dtype=torch.long)

    def scatter(self, name: str, packed: torch.Tensor) -> None:
        """Set a per-token field of every sample from its packed form."""
        for sample, values in zip(self.samples, torch.split(packed, self.lengths), strict=True):
            setattr(sample, name, values)


def with_usable_images(samples: Sequence[Sample], processor: VisionProcessor | None
                       ) -> tuple[list[Sample], list[VisionInputs | None]]:
    """The samples whose images the learner can use, each with its images processed (None for a sample without).
    One whose images do not decode, or do not match the image tokens of its `tokens`, or that brings images to a
    model without a vision tower, is dropped with a warning naming it and why (`BAD_IMAGE_SAMPLES` counts them):
    one corrupt sample must not stop the learner."""
    kept: list[Sample] = []
    inputs: list[VisionInputs | None] = []
    for sample in samples:
        where = f"sample {sample.sample_id} (group {sample.group_id})"
        tokens = np.asarray(sample.tokens)
        generated = 0 if processor is None else int((tokens[sample.prompt_tokens:] == processor.image_token_id).sum())
        if not sample.images and not generated:
            kept.append(sample)
            inputs.append(None)
            continue
        try:
            if processor is None:
                raise ValueError(f"{where}: {len(sample.images)} image(s), but the model has no vision tower")
            if generated:  # an engine that does not hold the placeholder back (ours does: vision_rows.py)
                raise ValueError(f"{where}: its response holds {generated} image placeholder token(s) the model "
                                 "generated; a forward would take them for image slots")
            vision = processor.encode(sample.images, where=where)
            processor.check_expanded(tokens[: sample.prompt_tokens].tolist(), vision, where=where)
        except ValueError as error:  # ImageProblem included
            logger.warning("dropped a sample whose images cannot be used: %s", error)
            continue
        kept.append(sample)
        inputs.append(vision)
    return kept, inputs


def to_train_sample(sample: Sample, *, rewarded: bool, newest_version_only: bool = False,
                    vision: VisionInputs | None = None) -> TrainSample:
    """Copies out of the decoded frame: bus arrays are read-only views that must not outlive the message.

    `rewarded`: the step trains on rewards (every loss but SFT's), so the sample must have one (`trained_reward`);
    an SFT sample learns its label and carries none, whatever a reward worker gave it (the batch's metrics report
    that). `newest_version_only` (--mask-offpolicy-in-partial-rollout): a sample generated across a weight update
    trains only on the tokens of its newest weights; the older part stays in the sequence as context, loss mask 0.
    """
    length = int(sample.response_length)
    mask = loss_mask_of(sample)
    if newest_version_only:
        mask = mask * newest_version_tokens(sample)
    rollout, teacher = sample.rollout_log_probs, sample.teacher_log_probs
    graded = sample.step_ends is not None and sample.step_rewards is not None
    return TrainSample(
        tokens=torch.tensor(np.asarray(sample.tokens), dtype=torch.long),
        response_length=length,
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        rollout_log_probs=None if rollout is None else torch.tensor(np.asarray(rollout), dtype=torch.float32),
        teacher_log_probs=None if teacher is None else torch.tensor(np.asarray(teacher), dtype=torch.float32),
        reward=trained_reward(sample) if rewarded else None,
        routed_experts=_routes(sample),
        vision=vision,
        step_ends=torch.tensor(np.asarray(sample.step_ends), dtype=torch.long) if graded else None,
        step_rewards=torch.tensor(np.asarray(sample.step_rewards), dtype=torch.float32) if graded else None,
    )


def trained_reward(sample: Sample) -> float:
    """The reward an RL step trains `sample` on. The buffer admits only samples with a finite reward; one without
    came around it (a recorded batch, `--load-debug-rollout-data`, not written by a run's buffer) and is refused
    here by name rather than trained as a reward of 0."""
    if sample.reward is None:
        raise ValueError(f"sample {sample.sample_id} (group {sample.group_id}) has no reward, and the step trains "
                         "on rewards: the buffer admits only rewarded samples, so this batch did not come from one")
    return float(sample.reward)


def _routes(sample: Sample) -> torch.Tensor | None:
    """The engine's routes (--use-rollout-routing-replay) as the trainer replays them: [len(tokens) - 1, layers, k]."""
    if sample.routed_experts is None:
        return None
    return torch.tensor(np.asarray(sample.routed_experts), dtype=torch.long).reshape(
        -1, sample.moe_layers, sample.moe_top_k)


def loss_mask_of(sample: Sample) -> np.ndarray:
    """The sample's loss mask as float32; a sample without one trains on every response token."""
    mask = sample.loss_mask if sample.loss_mask is not None else np.ones(int(sample.response_length))
    return np.asarray(mask, dtype=np.float32)


def newest_version_tokens(sample: Sample) -> np.ndarray:
    """1 where a response token came from the sample's newest weight version, 0 where from an older one."""
    versions = sample.token_versions
    if versions is None or not len(versions):
        return np.ones(int(sample.response_length), dtype=np.float32)
    versions = np.asarray(versions)
    return (versions == versions.max()).astype(np.float32)


def masked_older_tokens(samples: Sequence[Sample]) -> int:
    """Trained tokens that --mask-offpolicy-in-partial-rollout takes out of the loss, over a batch."""
    return sum(int(np.sum(loss_mask_of(s) * (1 - newest_version_tokens(s)))) for s in samples)


def to_step_batch(samples: Sequence[Sample], *, rewarded: bool, newest_version_only: bool = False,
                  teacher_of: Callable[[Sample], str] | None = None,
                  vision: Sequence[VisionInputs | None] | None = None) -> StepBatch:
    """`rewarded` and `newest_version_only`: see `to_train_sample`. `teacher_of` names each sample's distillation
    teacher (`actors.config.teachers.teacher_of`). `vision`: each sample's processed images
    (`with_usable_images`), None for a text model's batch."""
    images = vision if vision is not None else [None] * len(samples)
    return StepBatch(samples=[to_train_sample(s, rewarded=rewarded, newest_version_only=newest_version_only,
                                              vision=inputs)
                              for s, inputs in zip(samples, images, strict=True)],
                     group_ids=[s.group_id for s in samples],
                     teachers=[teacher_of(s) for s in samples] if teacher_of is not None else [],
                     episode_ids=[episode_id(s) for s in samples])


def unreplayable_routes(batch: StepBatch) -> int:
    """--use-rollout-routing-replay with samples that carry no routes (a rollout function that did not pass the
    engine's `routed_experts` on): the batch trains without replay, all of it, since a micro-batch cannot replay
    some of its samples and not others; returns how many lacked them (0: the batch replays as recorded)."""
    missing = sum(1 for sample in batch.samples if sample.routed_experts is None)
    if missing:
        for sample in batch.samples:
            sample.routed_experts = None
    return missing


def own_shard(batch: StepBatch, parallel: DataParallel) -> StepBatch:
    """This data-parallel rank's whole groups (the whole batch for a trainer that shards itself)."""
    if parallel.size == 1:
        return batch
    return batch.take(data_parallel_shard(batch.group_ids, batch.lengths, rank=parallel.rank, size=parallel.size))


def data_parallel_shard(group_ids: Sequence[str], lengths: Sequence[int], *, rank: int, size: int) -> list[int]:
    """Indices of the samples rank `rank` of `size` trains on: whole groups, dealt to balance response tokens.

    Whole groups keep group-relative advantages computable on each rank alone. Groups go largest first to the
    rank with the fewest tokens so far (ties to the lower rank), which every rank computes identically.
    """
    members: dict[str, list[int]] = {}
    for index, group_id in enumerate(group_ids):
        members.setdefault(group_id, []).append(index)
    if len(members) < size:
        raise ValueError(f"a batch of {len(members)} groups cannot feed {size} data-parallel ranks; "
                         f"raise --rollout-batch-size to at least {size}")
    load = [0] * size
    held = [0] * size
    mine: list[int] = []
    order = sorted(members.values(), key=lambda indices: (-sum(lengths[i] for i in indices), indices[0]))
    for indices in order:
        target = min(range(size), key=lambda r: (load[r], held[r], r))
        load[target] += sum(lengths[i] for i in indices)
        held[target] += 1
        if target == rank:
            mine.extend(indices)
    return sorted(mine)


def add_ref_log_probs(trainer: Trainer, batch: StepBatch, *, temperature: float) -> None:
    ref = trainer.compute_log_probs(batch.samples, temperature=temperature, model="ref").log_probs
    batch.scatter("ref_log_probs", ref)


def add_teacher_log_probs(trainer: Trainer, batch: StepBatch, held: Collection[str], *, temperature: float) -> None:
    """Each sample's teacher log-probs: scored here by the teachers the trainer holds (`held`), one forward per
    teacher over its samples; a server teacher's arrived with the sample (the reward worker asked the server)."""
    for name in dict.fromkeys(batch.teachers):
        if name not in held:
            continue
        members = [index for index, teacher in enumerate(batch.teachers) if teacher == name]
        scored = trainer.compute_log_probs([batch.samples[i] for i in members], temperature=temperature,
                                           model=teacher_role(name)).log_probs
        lengths = [batch.samples[i].response_length for i in members]
        for index, values in zip(members, torch.split(scored, lengths), strict=True):
            batch.samples[index].teacher_log_probs = values
    for index, sample in enumerate(batch.samples):
        if sample.teacher_log_probs is None:
            raise ValueError(f"sample {index} of group {batch.group_ids[index]} has no log-probs from its teacher "
                             f"{batch.teachers[index] if batch.teachers else '(none named)'!r}: a teacher server's "
                             "scores come with the sample from the reward worker")


def add_values(trainer: Trainer, batch: StepBatch) -> None:
    """The critic's values of this shard's tokens before the step: GAE's baseline and the value clip's anchor."""
    batch.scatter("values", trainer.compute_values(batch.samples))


def add_old_log_probs(trainer: Trainer, batch: StepBatch, *, temperature: float, as_pi_old: bool = True,
                      with_entropy: bool = False) -> None:
    """pi_old by a separate no-grad forward of the policy (see `policies.step_loss.pi_old_source` for when);
    `with_entropy` also keeps each token's entropy (slime's --use-rollout-entropy), and without `as_pi_old` that
    is all the forward is for."""
    outputs = trainer.compute_log_probs(batch.samples, temperature=temperature, with_entropy=with_entropy)
    if with_entropy:
        assert outputs.entropy is not None  # asked for
        for sample, values in zip(batch.samples, torch.split(outputs.entropy.detach().cpu(), batch.lengths),
                                  strict=True):
            sample.rollout_entropy = values
    if not as_pi_old:
        return
    batch.scatter("old_log_probs", outputs.log_probs)
    if outputs.routed_experts is not None:  # --use-routing-replay: the training forwards route as pi_old did
        for sample, routes in zip(batch.samples, outputs.routed_experts, strict=True):
            sample.routed_experts = routes


def rollout_entropy_metric(batch: StepBatch) -> dict[str, float]:
    """slime's `rollout/entropy`: each sample's mean entropy over its trained tokens, averaged over the samples."""
    means = [float((s.rollout_entropy * mask).sum() / mask.sum().clamp_min(1))
             for s in batch.samples if s.rollout_entropy is not None
             for mask in [s.loss_mask.float().cpu() if s.loss_mask is not None else torch.ones(s.response_length)]]
    return {"rollout/entropy": float(np.mean(means))} if means else {}


def add_advantages(policy: PolicyLossConfig, batch: StepBatch, parallel: DataParallel, *,
                   custom: AdvantageFunction | None = None) -> dict[str, float]:
    """Advantages of this shard; whole groups are on one rank, so only whitening spans ranks. Group baselines are
    over episodes: an agent's episode of several segments counts once, and each segment gets its advantage.

    `DataParallel.group` None means the default group, but `compute_advantages` reads None as "this process
    only", so the world group is named explicitly: otherwise each rank would whiten by its own statistics.
    `custom` (an `AdvantageFunction`, e.g. slime's --custom-advantage-function-path) replaces the estimator.
    Returns the distillation metrics of this shard (none without `use_opd`).
    """
    group = None
    if parallel.size > 1:
        group = parallel.group if parallel.group is not None else torch.distributed.group.WORLD
    group_ids = batch.group_index()
    episode_ids = torch.empty(len(batch.samples), dtype=torch.long)
    for number, members in enumerate(batch.episodes):
        episode_ids[members] = number
    old = batch.packed("old_log_probs")
    student = old if old is not None else batch.packed("rollout_log_probs")  # pi_old, else the engine's
    teacher = batch.packed("teacher_log_probs")
    if custom is not None:  # the run config refuses it beside use_opd (the function replaces all of this)
        batch.scatter("advantages", custom(policy, batch.samples, group_ids, process_group=group))
        return {}
    values = batch.packed("values")
    steps = graded_steps(batch.samples)
    rewards = [s.reward for s in batch.samples]  # each set by `to_step_batch` for a step that trains on rewards
    advantages, returns = compute_advantages(
        policy,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=group_ids,
        response_lengths=batch.response_lengths(),
        loss_mask=batch.packed("loss_mask"),
        log_probs=student,  # read only for kl_coef and use_opd
        ref_log_probs=batch.packed("ref_log_probs"),
        teacher_log_probs=teacher,
        values=values,
        process_group=group,
        episode_ids=episode_ids,
        steps=steps,
    )
    batch.scatter("advantages", advantages.float())
    metrics = _distillation_metrics(policy, batch, student, teacher)
    if steps is not None:  # process supervision at work: how finely the rewards graded the responses
        metrics["rollout/graded_steps"] = steps.samples.numel() / len(batch.samples)
    if values is not None:  # the critic's targets, and how much of them its values already explain
        batch.scatter("returns", returns.float())
        loss_mask = batch.packed("loss_mask")
        assert loss_mask is not None
        # A batch whose samples all scored alike has no outcome to explain: its returns differ only by the critic's
        # own bootstrap (lambda < 1), and 1 - Var(R - V) / Var(R) over that near-zero spread reads as -50 or -100.
        metrics["critic/explained_variance"] = (
            explained_variance(values, returns, loss_mask) if len(set(rewards)) > 1 else float("nan"))
    return metrics


def graded_steps(samples: Sequence[TrainSample]) -> GradedSteps | None:
    """The steps the samples' rewards graded (process supervision), in the estimators' form; None when none did."""
    graded = [(index, s.step_ends, s.step_rewards) for index, s in enumerate(samples)
              if s.step_ends is not None and s.step_rewards is not None]
    if not graded:
        return None
    return GradedSteps(samples=torch.cat([torch.full((len(ends),), index, dtype=torch.long)
                                          for index, ends, _ in graded]),
                       ends=torch.cat([ends for _, ends, _ in graded]),
                       rewards=torch.cat([rewards for _, _, rewards in graded]))


def _distillation_metrics(policy: PolicyLossConfig, batch: StepBatch, student: torch.Tensor | None,
                          teacher: torch.Tensor | None) -> dict[str, float]:
    if not policy.use_opd or student is None or teacher is None or not batch.samples:
        return {}
    loss_mask = batch.packed("loss_mask")
    assert loss_mask is not None
    return reverse_kl_means(student, teacher, loss_mask, batch.response_lengths(), batch.teachers)


def mini_batches(batch: StepBatch, steps: int, parallel: DataParallel) -> list[StepBatch]:
    """This rank's batch cut into `steps` consecutive, near-equal mini-batches, one per optimizer step.

    Cut after the advantages (they need whole groups), so a group may span two steps, as in slime, which cuts
    each data-parallel rank's samples in order. Each rank cuts its own shard, so step k trains every rank's k-th
    piece: about batch / steps samples over all ranks (exactly that with a trainer that shards itself, e.g.
    Megatron, which receives the whole batch). One step returns the batch itself. What is cut is episodes: an
    episode's segments train in one step, and `--global-batch-size` counts episodes, as slime's counts rollouts.
    """
    if steps == 1:
        return [batch]
    episodes = batch.episodes
    fewest = len(episodes)
    if parallel.size > 1:  # agreed over the ranks, so a short shard fails every rank alike instead of a hang
        count = torch.tensor([fewest], dtype=torch.int64, device=_collective_device(parallel))
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=parallel.group)
        fewest = int(count.item())
    if fewest < steps:
        where = "" if parallel.size == 1 else f" on some data-parallel rank (of {parallel.size})"
        raise ValueError(f"{fewest} samples{where} cannot make {steps} optimizer steps "
                         "(--num-steps-per-rollout / --global-batch-size): each step needs at least one sample")
    bounds = [k * len(episodes) // steps for k in range(steps + 1)]
    return [batch.take([index for members in episodes[start:end] for index in members])
            for start, end in pairwise(bounds)]


def with_gradient(batch: StepBatch) -> StepBatch:
    """The samples whose advantages are not all zero, in order. A batch that scored alike everywhere keeps one
    sample with a trained token: the step is then taken with a zero gradient, as it would be over the whole batch
    (AdamW's moments still move the weights and the version advances), where a sample with no trained token would
    make the trainer skip the step as empty.

    Call only where a zero-advantage sample adds nothing to the gradient (`zero_advantage_is_zero_gradient`)."""
    kept = [index for index, sample in enumerate(batch.samples)
            if sample.advantages is None or bool(sample.advantages.any())]
    if not kept:
        kept = [next((index for index, sample in enumerate(batch.samples)
                      if sample.loss_mask is None or bool(sample.loss_mask.any())), 0)]
    return batch.take(kept)


def build_loss(
    policy: PolicyLossConfig, batch: StepBatch, parallel: DataParallel, *, pi_old_from_forward: bool,
    trained: StepBatch | None = None, loss_fn: PolicyLossFunction | None = None, pg_reducer: PgReducer | None = None,
) -> PolicyLoss:
    """One optimizer step's loss with that step's denominators: its mini-batch on every rank counts (one
    all-reduce when sharded). With several steps per rollout batch each step divides by its own counts, as slime
    normalises per step (per token of the step with --calculate-per-token-loss, else per sample of the step).
    `trained`: the part of `batch` the trainer will run (`with_gradient`); the denominators stay the whole
    batch's, the diagnostics become means over the samples trained. `loss_fn`: the loss as loaded
    (`actors.extensions.load.policy_loss`); `pg_reducer`: the policy-gradient term's numerator, as loaded
    (`actors.extensions.load.pg_loss_reducer`)."""
    loss_mask = batch.packed("loss_mask")
    assert loss_mask is not None  # to_train_sample always sets one
    counts = step_denominators(
        policy,
        loss_mask=loss_mask,
        response_lengths=batch.response_lengths(),
        old_log_probs=batch.packed("old_log_probs"),
        rollout_log_probs=batch.packed("rollout_log_probs"),
    )
    if trained is not None:  # the trained samples' tokens weigh the diagnostics
        trained_mask = trained.packed("loss_mask")
        assert trained_mask is not None
        counts = torch.cat([counts[:1], trained_mask.sum().reshape(1).to(counts.dtype)])
    if parallel.size > 1:
        counts = counts.to(_collective_device(parallel))
        torch.distributed.all_reduce(counts, group=parallel.group)
        counts = counts.cpu()
    return PolicyLoss(policy, denominator=float(counts[0]), total_tokens=max(1.0, float(counts[1])),
                      pi_old_from_forward=pi_old_from_forward, loss_fn=loss_fn, pg_reducer=pg_reducer)


def build_value_loss(policy: PolicyLossConfig, batch: StepBatch, parallel: DataParallel) -> ValueLoss:
    """The critic's loss for one optimizer step, with that step's denominators over every rank (`build_loss`)."""
    loss_mask = batch.packed("loss_mask")
    assert loss_mask is not None
    counts = value_denominators(policy, loss_mask=loss_mask, response_lengths=batch.response_lengths())
    if parallel.size > 1:
        counts = counts.to(_collective_device(parallel))
        torch.distributed.all_reduce(counts, group=parallel.group)
        counts = counts.cpu()
    return ValueLoss(policy, denominator=float(counts[0]), total_tokens=max(1.0, float(counts[1])))


def _collective_device(parallel: DataParallel) -> torch.device:
    """Where a tensor of our own collectives must sit: NCCL carries only CUDA tensors, gloo CPU ones."""
    if torch.distributed.get_backend(parallel.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
