"""The weight-transfer interface: a learner-side sender and engine-side receivers of named tensors.

A transfer is versioned and acknowledged: the sender's `committed_version` moves only after every receiver
reported that its `load_fn` returned, so the version the learner announces is one every engine really serves.
A receiver that is missing, dies or fails to load is named in a `WeightTransferError`; the sender's own state
(and the learner's model, which it only reads) is never changed by a failed transfer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

LoadFn = Callable[[Iterable[tuple[str, Tensor]]], None]
"""Copies the given tensors into the live model in place. Called once per bucket; the tensors are views of a
receive buffer that is reused afterwards, so copy them, never keep references."""


class WeightTransferError(RuntimeError):
    """A transfer or group formation failed; `failed` maps each receiver at fault to what went wrong."""

    def __init__(self, message: str, failed: Mapping[str, str] | None = None) -> None:
        self.failed = dict(failed or {})
        detail = "; ".join(f"{name}: {reason}" for name, reason in self.failed.items())
        super().__init__(f"{message} [{detail}]" if detail else message)


@dataclass(frozen=True)
class TransferReport:
    """What one successful transfer moved, and how fast (bytes per receiver, wall time to the last ack)."""

    version: int
    receivers: tuple[str, ...]
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float

    @property
    def gigabytes_per_second(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class WeightSender(ABC):
    """Learner rank 0's end of the transfer group."""

    @property
    @abstractmethod
    def committed_version(self) -> int | None:
        """The last version every receiver acknowledged (None before the first success)."""

    @abstractmethod
    def send(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        version: int,
        *,
        dtype: torch.dtype | None = None,
        timeout_s: float | None = None,
    ) -> TransferReport:
        """Broadcast `named_tensors` (cast to `dtype` if given) and commit `version` once all receivers acked."""

    @abstractmethod
    def close(self) -> None: ...


class WeightReceiver(ABC):
    """An inference engine's end of the transfer group."""

    @abstractmethod
    def receive(self, load_fn: LoadFn, timeout: float, *, destinations: Mapping[str, Tensor] | None = None) -> int:
        """Wait up to `timeout` seconds for the next transfer, load it, and return its version.

        Tensors go through `load_fn`, except those an implementation can write straight into `destinations`
        (the engine's live tensors by name), which skip the staging copy.
        """

    @abstractmethod
    def close(self) -> None: ...
