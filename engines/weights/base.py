"""The weight-transfer interface: a learner-side sender and engine-side receivers of named tensors.

A transfer is versioned and acknowledged: the sender's `committed_version` moves only after every receiver
reported that its `load_fn` returned, so the version the learner announces is one every engine really serves.
A receiver that is missing, dies or fails to load is named in a `WeightTransferError`; the sender's own state
(and the learner's model, which it only reads) is never changed by a failed transfer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from engines.weights.fingerprint import FingerprintCheck

LoadFn = Callable[[Iterable[tuple[str, Tensor]]], None]
"""Copies the given tensors into the live model in place. Called once per bucket; the tensors are views of a
receive buffer that is reused afterwards, so copy them, never keep references."""


class WeightTransferError(RuntimeError):
    """A transfer or group formation failed; `failed` maps each receiver at fault to what went wrong."""

    def __init__(self, message: str, failed: Mapping[str, str] | None = None) -> None:
        self.failed = dict(failed or {})
        detail = "; ".join(f"{name}: {reason}" for name, reason in self.failed.items())
        super().__init__(f"{message} [{detail}]" if detail else message)


class WeightsDiffer(WeightTransferError):
    """Every engine acknowledged, but one or more serve other bits than the learner sent (`check.differ`)."""

    def __init__(self, message: str, check: FingerprintCheck) -> None:
        self.check = check
        super().__init__(message, check.problems())


REPAIR = "repair after "  # how `TransferReport.full_because` starts when a push repairs engines a failed one left


@dataclass(frozen=True)
class TransferReport:
    """What one successful transfer moved, and how fast (bytes per receiver on the wire, wall time to the last ack),
    and whether the engines serve what was sent (None: not asked for, or a mechanism that cannot tell)."""

    version: int
    receivers: tuple[str, ...]
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float
    fingerprints: FingerprintCheck | None = None
    delta_base: int | None = None  # a delta push against this version (`num_bytes` its encoded bytes); None: full
    full_bytes: int | None = None  # what the push would send whole, where a mechanism can send less (deltas)
    full_because: str | None = None  # under delta sync, why this push went whole (an anchor, a repair, ...)


def require_usable(group: object, broken: str | None, what: str) -> None:
    """A transfer runs only on a group that formed (`wait_for_receivers`) and that no failure broke since; `what`
    names the group. The same rule and the same advice for every mechanism: a broken group is never repaired."""
    if group is None or broken is not None:
        raise WeightTransferError(
            f"{what} is not usable ({broken or 'wait_for_receivers() not called'}); call open_group() again"
        )


class GroupHandle(Protocol):
    """What `open_group` returns: who must receive, and the spec the engines' loaders need, as plain values.

    `to_dict()` travels in `WeightUpdateOrder.group` and MUST carry `"transport"`, the mechanism's name in
    `engines.weights.transport`, so the engine side builds the loader for it by name.
    """

    @property
    def receivers(self) -> tuple[str, ...]: ...

    def to_dict(self) -> dict[str, Any]: ...


class WeightSender(ABC):
    """Learner rank 0's end of the transfer group.

    Use: `spec = open_group([sender, *engines])`, hand `spec.to_dict()` to the engines, `wait_for_receivers()`,
    then `send(...)` per version; after a WeightTransferError, `open_group` again with the live engines (after
    `abort(...)` too).

    `phase_hook`, when set, is called from the sending thread at named points of a transfer, so a fault can be
    injected exactly there (the chaos matrix kills the learner at "buckets_sent": every bucket broadcast, no
    acknowledgement collected). A mechanism calls `reached` where it has such a point; others never call it.
    """

    phase_hook: Callable[[str], None] | None = None

    def reached(self, point: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(point)

    @property
    @abstractmethod
    def committed_version(self) -> int | None:
        """The last version every receiver acknowledged (None before the first success)."""

    @abstractmethod
    def open_group(self, members: Sequence[str]) -> GroupHandle:
        """Start a new group generation of `members` (members[0] is the sender), dropping the current one."""

    @abstractmethod
    def wait_for_receivers(self, timeout_s: float | None = None) -> None:
        """Block until every receiver of the open generation joined; raise WeightTransferError naming the rest."""

    @abstractmethod
    def send(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        version: int,
        *,
        dtype: torch.dtype | None = None,
        timeout_s: float | None = None,
        fingerprint: bool = False,
    ) -> TransferReport:
        """Broadcast `named_tensors` (cast to `dtype` if given) and commit `version` once all receivers acked.

        `fingerprint`: check that every engine serves what was sent (`fingerprint.py`); a mechanism that cannot
        leaves `TransferReport.fingerprints` None, and the learner records the push as not checked.

        `named_tensors` may be a generator (the learner's holds its ranks' lock until exhausted or closed): it is
        iterated once, and its tensors are read, never modified.
        """

    def abort(self, failed: Mapping[str, str]) -> None:
        """Give the open generation up because of `failed` (member -> why), from any thread: a `wait_for_receivers`
        or `send` blocked on a member known to be gone raises WeightTransferError now, not at its timeout.

        The learner calls it when the roster says a member died or was replaced. A mechanism that cannot be
        interrupted keeps this default and its calls end at their timeouts."""
        return None

    def waiting_on(self) -> list[str]:
        """The receivers a blocked `wait_for_receivers` or `send` still waits for, from any thread: what the
        learner names when a push takes long. Best effort; the default knows nothing."""
        return []

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
