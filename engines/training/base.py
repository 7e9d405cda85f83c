"""The trainer interface and the batch layout it shares with `policies/`.

Layout. A sample is its full token sequence (prompt + response) and the number of response tokens at its end.
Everything per-token that the loss needs lives only on RESPONSE tokens, and a batch carries it as ONE packed
1-D tensor (responses concatenated in sample order) plus `response_lengths`. The trainer returns its
log-probs in exactly that layout, so a loss is elementwise arithmetic on aligned tensors: no padding, no masks
for padding, no reshapes. The fields are typed attributes, not string keys: a misspelt field fails at once.

Normalisation. A step is split into micro-batches (token budget) and, with several learner processes, into
data-parallel shards. The trainer SUMS the gradients of every micro-batch of every rank, so a loss must divide
by the counts of the WHOLE step. The trainer does not know which counts a loss needs (tokens kept after an
off-policy rejection, sequences, rollouts), so it computes none: the `Loss` object is built before the step with
its denominators already global (see `policies.step_loss.PolicyLoss`). Metrics follow the same rule: the trainer
SUMS each metric over micro-batches and ranks, so a loss reports each as this micro-batch's share of the step.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from engines.training.config import TrainerOptimizerConfig
from engines.training.schedule import lr_multiplier
from engines.vision.processor import VisionInputs

ModelRole = str
"""Which network `compute_log_probs` runs: "policy", "ref" (the frozen reference), or `teacher_role(name)` (a
distillation teacher the trainer holds)."""
TEACHER_ROLE_PREFIX = "teacher:"

# How a trainer names and shapes the tensors it sends (`Trainer.named_tensors`).
WeightLayout = Literal["model", "checkpoint"]


def teacher_role(name: str) -> ModelRole:
    return f"{TEACHER_ROLE_PREFIX}{name}"


@dataclass(kw_only=True)
class TokenFields:
    """The per-token fields, each None or a 1-D tensor over response tokens: one sample's (`TrainSample`), or
    every sample's concatenated (`PackedBatch`). Declared once so that the two layouts cannot drift apart.

    `loss_mask` (1 = trained; None trains every token), `rollout_log_probs` (mu, the engine's), `old_log_probs`
    (pi_old, the learner's before the step), `ref_log_probs` (the frozen reference model's), `teacher_log_probs`
    (a distillation teacher's), `advantages`, and for PPO with a critic `values` (the critic's before the step) and
    `returns` (its regression targets).
    """

    loss_mask: Tensor | None = None
    rollout_log_probs: Tensor | None = None
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    teacher_log_probs: Tensor | None = None
    advantages: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None


TOKEN_FIELDS = tuple(f.name for f in fields(TokenFields))
"""The per-token fields a sample may carry, each with exactly `response_length` entries when present."""


@dataclass
class TrainSample(TokenFields):
    """One sequence to score or train on.

    `tokens` are the prompt followed by the response; the last `response_length` of them are the response.
    Every per-token field (`TokenFields`, keyword-only) is None or a 1-D tensor of `response_length` entries.
    `reward` is the sample's scalar reward where a step trains on rewards: the learner requires it there
    (`actors.learner.stages.trained_reward`), from the buffer, which admits only finite ones. It is None on a sample
    that is only scored (a forward) or learns a label (SFT); no trainer reads it, the advantages do.
    """

    tokens: Tensor
    response_length: int
    reward: float | None = None
    # MoE routing replay: the experts each token but the last was routed to, [len(tokens) - 1, layers, k] (slime's
    # and SGLang's layout); a forward of the policy then routes as these say (engines.training.moe)
    routed_experts: Tensor | None = None
    # a vision-language model's images of this sample's prompt, processed (`engines.vision`); its tokens hold their
    # placeholders expanded
    vision: VisionInputs | None = None
    # slime's --use-rollout-entropy: the entropy of each response token's distribution under the policy before the
    # step (the pi_old forward's), [response_length]; read by slime's hooks and metrics, never by a loss
    rollout_entropy: Tensor | None = None
    # process supervision: the response token each graded step ends on ([S] long, in order) and its reward ([S]);
    # read by the advantages (grpo_process), never by a trainer
    step_ends: Tensor | None = None
    step_rewards: Tensor | None = None

    @property
    def prompt_length(self) -> int:
        return int(self.tokens.numel()) - self.response_length

    def present_fields(self) -> tuple[str, ...]:
        """Names of the per-token fields that this sample carries (not None)."""
        return tuple(name for name in TOKEN_FIELDS if getattr(self, name) is not None)

    def validate(self, index: int) -> None:
        """Raise a ValueError naming sample `index` and the field at fault; the trainer calls this on entry."""
        where = f"sample {index}"
        if not isinstance(self.tokens, Tensor) or self.tokens.dim() != 1:
            raise ValueError(f"{where}: tokens must be a 1-D LongTensor, got {_describe(self.tokens)}")
        if self.tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{where}: tokens must be integer ids, got dtype {self.tokens.dtype}")
        if not 0 <= self.response_length < self.tokens.numel():
            raise ValueError(
                f"{where}: response_length {self.response_length} must be in [0, {self.tokens.numel() - 1}] "
                f"(len(tokens)={self.tokens.numel()}; the first response token needs at least one prompt token)"
            )
        routes = self.routed_experts
        if routes is not None and (not isinstance(routes, Tensor) or routes.dim() != 3
                                   or routes.shape[0] != self.tokens.numel() - 1 or routes.is_floating_point()):
            raise ValueError(f"{where}: routed_experts must be integer experts of shape [len(tokens) - 1 = "
                             f"{self.tokens.numel() - 1}, layers, k], got {_describe(routes)}")
        for name in TOKEN_FIELDS:
            values = getattr(self, name)
            if values is None:
                continue
            if not isinstance(values, Tensor) or values.dim() != 1 or values.numel() != self.response_length:
                raise ValueError(
                    f"{where}: token field {name!r} must be a 1-D tensor of response_length={self.response_length}"
                    f" entries, got {_describe(values)}"
                )
        if self.reward is not None and not isinstance(self.reward, int | float):
            raise ValueError(f"{where}: reward must be a number, got {_describe(self.reward)}")


@dataclass
class PackedBatch(TokenFields):
    """Samples in the packed layout: per-token fields concatenated over responses. The rewards are not here: no
    loss reads them (they reach the loss as advantages).

    A field is None when the samples do not carry it (every sample of a batch carries the same fields).
    """

    response_lengths: Tensor

    @property
    def num_samples(self) -> int:
        return int(self.response_lengths.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.response_lengths.sum())

    def sample_index(self) -> Tensor:
        """For each packed token, the index of its sample: the key for per-sequence reductions."""
        return torch.repeat_interleave(
            torch.arange(self.num_samples, device=self.response_lengths.device), self.response_lengths
        )

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the batch holds, by field name (what must sit on the model's device)."""
        names = ("response_lengths", *TOKEN_FIELDS)
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass
class ModelOutputs:
    """What the model says about the response tokens, packed like the per-token fields of `PackedBatch`.

    `log_probs[i]` is log p(token_i | prefix) under softmax(logits / temperature); `entropy[i]` is the entropy
    of that same distribution (None unless asked for, since it costs another vocabulary-sized pass).
    """

    log_probs: Tensor
    entropy: Tensor | None = None
    # each sample's experts, as `TrainSample.routed_experts`, from a policy forward of a trainer that records them
    # (MoE routing replay); None otherwise
    routed_experts: list[Tensor] | None = None


class Loss(Protocol):
    """What `Trainer.train_step` calls on each micro-batch: `(outputs, batch) -> (scalar loss, metrics)`.

    Structural, so `policies/` builds losses without importing the engines. The loss must already be divided by
    the whole step's counts and report metrics as this micro-batch's share (module docstring).
    """

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict[str, float]]: ...


class ValueLossFn(Protocol):
    """What `Trainer.train_critic` calls on each micro-batch: `(predicted values [N], batch) -> (loss, metrics)`,
    divided by the whole step's counts like `Loss`."""

    def __call__(self, values: Tensor, batch: PackedBatch) -> tuple[Tensor, dict[str, float]]: ...


LossFn = Loss  # the earlier name, kept while tools/sim/learner.py (being written alongside) still uses it


@dataclass(frozen=True)
class StepResult:
    """Outcome of one `train_step`. A skipped step applied no update and left `version` unchanged."""

    version: int
    metrics: dict[str, float]
    grad_norm: float
    skipped: bool = False
    skip_reason: str | None = None


@dataclass(frozen=True)
class DataParallel:
    """A rank's place among the ranks that receive different samples; `group` None is the default group."""

    rank: int
    size: int
    group: Any = None


class Trainer(ABC):
    """A policy (and optional frozen reference) model with its optimizer, seen as a versioned function.

    `version` is the policy version every generated token is tagged with: the number of rollout batches whose
    training applied an update (equal to the optimizer steps applied with one step per batch; `VersionCounter`).
    Methods that touch the model are collective when the trainer spans several data-parallel processes: every
    rank calls them, each with its own shard of samples.
    """

    @property
    @abstractmethod
    def version(self) -> int: ...

    @abstractmethod
    def compute_log_probs(self, samples: Sequence[TrainSample], *, temperature: float, with_entropy: bool = False,
                          model: ModelRole = "policy") -> ModelOutputs:
        """Log-probs (and entropy) of each sample's response tokens, packed in sample order, without gradients."""

    @abstractmethod
    def train_step(self, samples: Sequence[TrainSample], loss: Loss, *, temperature: float, with_entropy: bool = False,
                   ends_batch: bool = True) -> StepResult:
        """One optimizer step on `samples`. A non-finite loss or gradient norm skips the update and says so.

        `ends_batch` False: more optimizer steps of the same rollout batch follow, so the policy version does
        not advance yet (see `VersionCounter`). The learner passes it only when a batch takes several steps,
        so a trainer written for one step per batch keeps working without it.
        """

    @abstractmethod
    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """Write weights, optimizer state, version and `extra_state` (JSON-serialisable) atomically."""

    @abstractmethod
    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote and return its `extra_state`."""

    @abstractmethod
    def named_tensors(self, layout: WeightLayout = "model") -> Iterator[tuple[str, Tensor]]:
        """The policy's weights under their Hugging Face names: what a weight transfer sends to the engines.

        "model": as transformers holds the model in memory (a torch engine's parameters); "checkpoint": as its
        checkpoint stores it, for engines that load checkpoint names (SGLang). The two differ for a
        mixture-of-experts model, whose experts transformers stacks per layer (`engines.weights.layouts`), and for a
        vision-language model, whose modules transformers nests differently."""

    @abstractmethod
    def export_hf(self, directory: str | Path) -> None:
        """Write the policy as a Hugging Face folder that `from_pretrained` loads (weights, config, tokenizer)."""

    @property
    def has_critic(self) -> bool:
        """Whether the trainer holds a value model (PPO with a critic): `compute_values` and `train_critic` work."""
        return False

    @property
    def critic_steps(self) -> int:
        """Critic updates attempted so far (restored from a checkpoint): where a critic-only warm-up stands."""
        return 0

    def compute_values(self, samples: Sequence[TrainSample]) -> Tensor:
        """The critic's value of every response token's state (the prefix before it), packed, without gradients."""
        raise NotImplementedError(f"{type(self).__name__} holds no critic")

    def train_critic(self, samples: Sequence[TrainSample], loss: ValueLossFn) -> StepResult:
        """One optimizer step of the critic on `samples` (with `values` and `returns`); the policy is untouched and
        the version does not move. A non-finite loss or gradient skips the update and says so."""
        raise NotImplementedError(f"{type(self).__name__} holds no critic")

    def data_parallel(self) -> DataParallel:
        """Which share of a batch this rank trains on, and the group that sums what the shares count.

        A trainer that splits the batch itself (e.g. Megatron, whose data-parallel ranks are not the whole world)
        keeps this default: every rank receives the whole batch. The torch trainer's ranks are all
        data-parallel, so it reports its rank and world and expects each rank to pass its own shard.
        """
        return DataParallel(rank=0, size=1, group=None)

    def reset_optimizer_state(self) -> None:
        """Forget the optimizer's history (Adam's moments and step count), the critic's too: the next step starts
        as the first one did. slime's --reset-optimizer-states; the learner calls it before each rollout batch's
        steps."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset its optimizer state")

    def refresh_reference(self) -> None:
        """Make the frozen reference model a copy of the policy as it is now (slime's --ref-update-interval; the
        learner calls it every N rollout batches). Local to each rank: every rank holds its part of both models."""
        raise NotImplementedError(f"{type(self).__name__} cannot refresh its reference model")

    # Set by the learner where `gates_updates` holds: `train_step` calls it right before its first write of the
    # weights, and it returns once the weight push running beside the step has read them.
    update_gate: Callable[[], None] | None = None

    @property
    def gates_updates(self) -> bool:
        """Whether `train_step` calls `update_gate` before it writes the weights, and `named_tensors` may be read
        from another thread while a step runs. The learner then pushes a version while the next step's forward
        and backward run; only the optimizer's write waits. One process only: on several ranks, reading the
        weights is a collective of its own."""
        return False

    @property
    def prepares_beside_training(self) -> bool:
        """Whether the reference model may score one batch (`compute_log_probs(model="ref")`, from another thread)
        while `train_step` runs on the previous one. Only a trainer whose reference forward touches no state and
        no collective that training uses may say yes; the learner then overlaps the two."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, most trainers hold nothing to release
        """Release distributed resources; call before tearing down torch.distributed."""


@dataclass
class VersionCounter:
    """The policy version and the optimizer-step count of a trainer, which differ once a rollout batch takes
    several optimizer steps (`--num-steps-per-rollout`, or `--global-batch-size` below the batch).

    Decision: the VERSION advances once per rollout batch, after its last optimizer step, if any of the batch's
    steps applied an update. That is slime's meaning (weights are pushed after the whole rollout's training and
    samples are tagged by rollout id) and what the staleness accounting assumes: the buffer admits
    `(learner_version + max_staleness + 1) * groups_per_batch` groups, so a version must be worth one batch, and
    `--max-staleness` keeps counting batches whatever the steps per batch. The weights published between two
    versions are never an intermediate step's. `optimizer_steps` counts every applied update and drives the
    learning-rate schedule (warmup and decay are in optimizer steps, as in slime). A skipped step (non-finite
    loss or gradient) advances neither.
    """

    version: int = 0
    optimizer_steps: int = 0
    updated_in_batch: bool = False

    def after_step(self, *, applied: bool, ends_batch: bool) -> None:
        if applied:
            self.optimizer_steps += 1
            self.updated_in_batch = True
        if ends_batch and self.updated_in_batch:
            self.version += 1
            self.updated_in_batch = False

    def state(self) -> dict[str, int]:
        """What a checkpoint stores (written between batches, so no update is ever pending)."""
        return {"version": self.version, "optimizer_steps": self.optimizer_steps}

    def restore(self, state: dict[str, Any]) -> None:
        """From a checkpoint's state; one written before steps were counted apart has steps == version."""
        self.version = int(state["version"])
        self.optimizer_steps = int(state.get("optimizer_steps", self.version))
        self.updated_in_batch = False


class StepStats:
    """A step's loss and metric sums over the micro-batches one rank ran; each backend sums them over ranks.

    Values may be device tensors: they are summed where they are and read once, at the first look at a sum, so a
    step's micro-batches never wait for the device to report a number (a host sync each, on a GPU)."""

    def __init__(self) -> None:
        self._losses: list[Tensor | float] = []
        self._metrics: dict[str, list[Tensor | float]] = {}
        self._read: tuple[float, bool, dict[str, float]] | None = None

    def add(self, loss: Tensor | float, metrics: Mapping[str, Tensor | float]) -> None:
        self._losses.append(loss.detach() if isinstance(loss, Tensor) else loss)
        for key, value in metrics.items():
            self._metrics.setdefault(key, []).append(value.detach() if isinstance(value, Tensor) else value)
        self._read = None

    @property
    def loss_sum(self) -> float:
        return self._sums()[0]

    @property
    def nonfinite(self) -> bool:
        return self._sums()[1]

    @property
    def metric_sums(self) -> dict[str, float]:
        return self._sums()[2]

    def _sums(self) -> tuple[float, bool, dict[str, float]]:
        if self._read is None:
            keys = sorted(self._metrics)
            columns = [self._losses, *(self._metrics[key] for key in keys)]
            tensors = [value for column in columns for value in column if isinstance(value, Tensor)]
            read = iter(_read_scalars(tensors))
            values = [[next(read) if isinstance(value, Tensor) else float(value) for value in column]
                      for column in columns]
            self._read = (sum(values[0]), not all(math.isfinite(loss) for loss in values[0]),
                          {key: sum(column) for key, column in zip(keys, values[1:], strict=True)})
        return self._read


def _read_scalars(tensors: list[Tensor]) -> list[float]:
    """Scalar tensors as floats, in order, with one transfer per device they live on."""
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    values = [0.0] * len(tensors)
    for indices in by_device.values():
        read = torch.stack([tensors[index].reshape(()).double() for index in indices]).cpu().tolist()
        for index, value in zip(indices, read, strict=True):
            values[index] = value
    return values


def scheduled_lr(config: TrainerOptimizerConfig, optimizer_steps: int) -> float:
    """The learning rate of the update after `optimizer_steps` applied ones, under `config`'s schedule."""
    return config.lr * lr_multiplier(
        optimizer_steps,
        schedule=config.lr_schedule,
        warmup_steps=config.warmup_steps,
        total_steps=config.total_steps,
        min_lr_ratio=config.min_lr_ratio,
    )


def skip_reason(nonfinite_loss: bool, loss_sum: float, grad_norm: float, loss_tokens: int | None = None) -> str | None:
    """Why an update must not be applied, or None; the same rule for every backend. A step with no trained token
    (every loss mask 0, e.g. a sample filter that masked every response) has nothing to learn: its 0/0 loss is
    reported as what it is, not as a NaN, and Adam's momentum must not move the weights on zero gradients."""
    if loss_tokens == 0:
        return "no trained tokens (every loss mask is 0)"
    if nonfinite_loss:
        return f"non-finite loss ({loss_sum})"
    if not math.isfinite(grad_norm):
        return f"non-finite gradient norm ({grad_norm})"
    return None


def check_loss(loss: Any) -> None:
    """A loss must hand back a scalar with a gradient path; say so before backward() fails obscurely."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"the loss must return a scalar tensor as its loss, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise ValueError("the loss returned a value with no gradient path to outputs.log_probs")


def validate_samples(samples: Sequence[TrainSample]) -> None:
    """Every sample's layout, checked on entry so an error names the sample and the field."""
    for index, sample in enumerate(samples):
        sample.validate(index)


def select_model(role: ModelRole, policy: Any, ref: Any, teachers: Mapping[str, Any] | None = None) -> Any:
    """The network `compute_log_probs(model=role)` runs: the policy, the frozen reference, or a teacher."""
    if role == "policy":
        return policy
    if role == "ref":
        if ref is None:
            raise ValueError("compute_log_probs(model='ref') needs ref_model_path in the trainer config")
        return ref
    if role.startswith(TEACHER_ROLE_PREFIX):
        name = role.removeprefix(TEACHER_ROLE_PREFIX)
        if not teachers or name not in teachers:
            held = ", ".join(teachers or {}) or "none"
            raise ValueError(f"compute_log_probs(model={role!r}): no teacher {name!r} in the trainer (held: {held})")
        return teachers[name]
    raise ValueError(f"model must be 'policy', 'ref' or 'teacher:NAME', got {role!r}")


def step_result(
    version: int,
    metric_sums: dict[str, float],
    *,
    loss: float,
    lr: float,
    grad_norm: float,
    loss_tokens: int,
    sequences: int,
    micro_batches: int,
    started: float,
    skip_reason: str | None,
) -> StepResult:
    """The `StepResult` every trainer reports, with the same metric names whatever the backend.

    `loss_tokens` (response tokens with loss_mask != 0) and `sequences` are the step's totals over every rank,
    reported for the record; the loss never reads them (it carries its own denominators)."""
    metrics = {
        **metric_sums,
        "loss": loss,
        "lr": lr if skip_reason is None else 0.0,
        "grad_norm": grad_norm,
        "loss_tokens": float(loss_tokens),
        "sequences": float(sequences),
        "micro_batches": float(micro_batches),
        "step_seconds": time.perf_counter() - started,
    }
    return StepResult(version=version, metrics=metrics, grad_norm=grad_norm, skipped=skip_reason is not None,
                      skip_reason=skip_reason)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
