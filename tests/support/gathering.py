"""A weight source shaped like a sharded trainer's: each pass yields a fresh copy of every tensor, as Megatron
gathers a tensor's shards, and counts the copies whose memory is still alive."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator

from torch import Tensor


class Gathering:
    """Yields a fresh copy of each tensor, as a sharded trainer gathers them, and counts the copies whose memory
    is still alive (anything may hold it: a view, a detached alias, a broadcast in flight)."""

    def __init__(self, model: list[tuple[str, Tensor]], *, fail_at: int | None = None) -> None:
        self.model, self.fail_at = model, fail_at
        self.alive = self.peak = 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for position, (name, tensor) in enumerate(self.model):
            if position == self.fail_at:
                raise RuntimeError(f"all-gather of {name} failed")
            gathered = tensor.clone()
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            weakref.finalize(gathered.untyped_storage(), self._released)
            yield name, gathered
            del gathered

    def released_within(self, seconds: float) -> bool:
        """Whether every copy is freed within `seconds`. A gloo collective reports completion before its worker
        thread drops the tensor it sent, so the last copy may outlive the transfer by a moment (a full-suite run
        saw 1 alive right after a send returned); a copy something keeps stays alive past any deadline."""
        deadline = time.monotonic() + seconds
        while self.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.alive == 0

    def _released(self) -> None:
        self.alive -= 1
