"""The trainer interface and the batch layout it shares with `policies/`.

Layout. A sample is its full token sequence (prompt + response) and the number of response tokens at its end.
Everything per-token that the loss needs lives only on RESPONSE tokens, and a batch carries it as ONE packed
1-D tensor (responses concatenated in sample order) plus `response_lengths`. The trainer returns its
log-probs in exactly that layout, so a loss is elementwise arithmetic on aligned tensors: no padding, no masks
for padding, no reshapes.

Normalisation. A step is split into micro-batches (token budget) and, with several learner processes, into
data-parallel shards. The trainer sums the gradients of every micro-batch of every rank, so a loss function
must divide by the counts of the WHOLE step, which `LossNormalizer` carries (all-reduced once per step). A
token-mean loss is then `sum(per_token * mask) / normalizer.loss_tokens` on every micro-batch, and the summed
gradient equals the full-batch gradient exactly. Metrics follow the same rule: the trainer SUMS each metric
over micro-batches and ranks, so report each as this micro-batch's share of the step's value.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

ModelRole = Literal["policy", "ref"]


@dataclass
class TrainSample:
    """One sequence to score or train on.

    `tokens` are the prompt followed by the response; the last `response_length` of them are the response.
    Every tensor in `token_fields` has exactly `response_length` entries ("advantages", "loss_mask",
    "rollout_log_probs", "old_log_probs", "ref_log_probs", ...); `sample_fields` holds per-sequence scalars
    ("reward", "staleness", ...).
    """

    tokens: Tensor
    response_length: int
    token_fields: dict[str, Tensor] = field(default_factory=dict)
    sample_fields: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return int(self.tokens.numel()) - self.response_length

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
        for name, values in self.token_fields.items():
            if not isinstance(values, Tensor) or values.dim() != 1 or values.numel() != self.response_length:
                raise ValueError(
                    f"{where}: token field {name!r} must be a 1-D tensor of response_length={self.response_length}"
                    f" entries, got {_describe(values)}"
                )


@dataclass
class PackedBatch:
    """Samples in the packed layout: per-token fields concatenated over responses, per-sample fields stacked."""

    token_fields: dict[str, Tensor]
    sample_fields: dict[str, Tensor]
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


@dataclass
class ModelOutputs:
    """What the model says about the response tokens, packed like `PackedBatch.token_fields`.

    `log_probs[i]` is log p(token_i | prefix) under softmax(logits / temperature); `entropy[i]` is the entropy
    of that same distribution (None unless asked for, since it costs another vocabulary-sized pass).
    """

    log_probs: Tensor
    entropy: Tensor | None = None


@dataclass(frozen=True)
class LossNormalizer:
    """Counts over the whole optimizer step: every micro-batch of every data-parallel rank.

    `loss_tokens` is the number of response tokens with loss_mask != 0 (all response tokens when the batch has
    no "loss_mask"); `sequences` is the number of samples. Divide by these, never by a micro-batch's own count.
    """

    loss_tokens: int
    sequences: int

    def __post_init__(self) -> None:
        if self.loss_tokens < 0 or self.sequences < 0:
            raise ValueError(f"LossNormalizer counts must be non-negative, got {self}")


LossFn = Callable[[ModelOutputs, PackedBatch, LossNormalizer], tuple[Tensor, dict[str, float]]]
"""(outputs, batch, normalizer) -> (scalar loss to backpropagate, metrics). See the module docstring for the
normalisation rule that makes micro-batched, data-parallel steps equal the full-batch step."""


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

    `version` is the number of optimizer steps applied: the policy version every generated token is tagged with.
    Methods that touch the model are collective when the trainer spans several data-parallel processes: every
    rank calls them, each with its own shard of samples.
    """

    @property
    @abstractmethod
    def version(self) -> int: ...

    @abstractmethod
    def compute_log_probs(
        self,
        samples: Sequence[TrainSample],
        *,
        temperature: float,
        with_entropy: bool = False,
        model: ModelRole = "policy",
    ) -> ModelOutputs:
        """Log-probs (and entropy) of each sample's response tokens, packed in sample order, without gradients."""

    @abstractmethod
    def train_step(
        self, samples: Sequence[TrainSample], loss_fn: LossFn, *, temperature: float, with_entropy: bool = False
    ) -> StepResult:
        """One optimizer step on `samples`. A non-finite loss or gradient norm skips the update and says so."""

    @abstractmethod
    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """Write weights, optimizer state, version and `extra_state` (JSON-serialisable) atomically."""

    @abstractmethod
    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote and return its `extra_state`."""

    @abstractmethod
    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's weights under their Hugging Face names: what a weight transfer sends to the engines."""

    @abstractmethod
    def export_hf(self, directory: str | Path) -> None:
        """Write the policy as a Hugging Face folder that `from_pretrained` loads (weights, config, tokenizer)."""

    def data_parallel(self) -> DataParallel:
        """Which share of a batch this rank trains on, and the group that sums what the shares count.

        A trainer that splits the batch itself (e.g. Megatron, whose data-parallel ranks are not the whole world)
        keeps this default: every rank receives the whole batch. The torch trainer's ranks are all
        data-parallel, so it reports its rank and world and expects each rank to pass its own shard.
        """
        return DataParallel(rank=0, size=1, group=None)

    def close(self) -> None:  # noqa: B027 - optional hook, most trainers hold nothing to release
        """Release distributed resources; call before tearing down torch.distributed."""


def step_result(
    version: int,
    metric_sums: dict[str, float],
    *,
    loss: float,
    lr: float,
    grad_norm: float,
    normalizer: LossNormalizer,
    micro_batches: int,
    started: float,
    skip_reason: str | None,
) -> StepResult:
    """The `StepResult` every trainer reports, with the same metric names whatever the backend."""
    metrics = {
        **metric_sums,
        "loss": loss,
        "lr": lr if skip_reason is None else 0.0,
        "grad_norm": grad_norm,
        "loss_tokens": float(normalizer.loss_tokens),
        "sequences": float(normalizer.sequences),
        "micro_batches": float(micro_batches),
        "step_seconds": time.perf_counter() - started,
    }
    return StepResult(version=version, metrics=metrics, grad_norm=grad_norm, skipped=skip_reason is not None,
                      skip_reason=skip_reason)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
