"""The copies both ends of a torch.distributed push keep so a push can be a delta (`delta.py`), and the rules for
when it may be one.

The sender diffs each tensor against the values it last pushed, so it keeps them: one copy of the pushed weights in
the wire dtype, on the transfer device (a 135M-parameter model pushed as float32: 540 MB; as bfloat16: 270 MB).
An engine that offers its own tensors (`InferenceEngine.delta_target`: ones that hold exactly what was pushed, in
its dtype or a wider float) takes a delta straight into them and keeps nothing. For the rest the receiver keeps a
copy, applies the delta to it, and hands the engine the changed tensors whole through the load path a full push
takes, so whatever the engine does on load (merge an adapter, fill a stacked expert) happens as after a full push.
Either way the engine ends bit for bit where a full push would have left it.

A push is full (an anchor) unless every receiver is known to hold exactly the sender's copy: delta sync is off; no
push committed yet in this group generation (a new generation means an engine joined, left or restarted); the
last push failed, went uncommitted or was served differently (the fingerprint); every `anchor_every` versions; or
the tensors' names, dtypes or shapes changed. A receiver checks the base version a delta names against the one it
holds and refuses a delta it cannot apply, which fails the push: the next one is full.

A delta saves bytes and costs computation (the diff, the encoding, applying it), so it pays only where the wire is
slower than that work: across nodes, not over a loopback or NVLink (tools/bench/delta_push.py). The sender weighs
each delta push's seconds against what a full push of the same weights took (the last full push's seconds per
byte), and after a delta that was slower, pushes whole for `backoff` versions before it tries a delta again, twice
as many after each slower delta in a row (up to `MAX_BACKOFF_DOUBLINGS` doublings). Those full pushes keep no copy,
at either end, but the last one before the next try: they cost what a push without delta sync costs. The choice
changes the wire only; the engines end bit for bit where either push leaves them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from engines.training.lora import WIRE_SUFFIXES
from engines.weights import delta
from engines.weights.base import REPAIR, LoadFn, WeightsDiffer
from engines.weights.fingerprint import Fingerprints, comparable_dtype
from engines.weights.manifest import Manifest, TensorSpec

DEFAULT_ANCHOR_EVERY = 20
DEFAULT_BACKOFF = 8  # full pushes after a delta that was slower than a full one, before the next try
MAX_BACKOFF_DOUBLINGS = 4  # ... doubled after each slower delta in a row, at most this many times


class SenderCopy:
    """What the sender last pushed, and whether the engines of the open generation hold it."""

    def __init__(self, device: torch.device, *, anchor_every: int = DEFAULT_ANCHOR_EVERY,
                 backoff: int = DEFAULT_BACKOFF) -> None:
        """`backoff`: full pushes after a delta that took longer than a full push would have (0: deltas whatever
        they cost)."""
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        if backoff < 0:
            raise ValueError(f"backoff must be >= 0, got {backoff}")
        self.anchor_every, self.backoff = anchor_every, backoff
        self._device = device
        self._held: dict[str, Tensor] = {}
        self._specs: tuple[TensorSpec, ...] = ()
        self._version: int | None = None  # what every receiver of `_generation` acknowledged and serves
        self._generation = -1
        self._deltas_since_anchor = 0
        self._why_full = "no version pushed yet"
        self._full_seconds_per_byte: float | None = None  # the last full push's
        self._full_pushes_left = 0  # after a delta slower than a full push: full ones to go before the next try
        self._backoff_now = backoff  # how many the next slower delta sets
        self._slower = ""  # why, while they go

    @property
    def nbytes(self) -> int:
        """The memory the copy takes."""
        return sum(tensor.nbytes for tensor in self._held.values())

    def base_for(self, specs: Sequence[TensorSpec], generation: int) -> tuple[int | None, str]:
        """The version a push of `specs` may be a delta against, or None and why it must be full."""
        if self._version is None:
            return None, self._why_full
        if generation != self._generation:
            return None, "a new group generation: an engine joined, left or restarted"
        if self._full_pushes_left:
            return None, self._slower
        if self._deltas_since_anchor + 1 >= self.anchor_every:
            return None, f"the anchor every {self.anchor_every} versions"
        if tuple(specs) != self._specs:
            return None, "the tensors' names, dtypes or shapes changed"
        return self._version, ""

    def keeps(self) -> bool:
        """Whether the push about to go keeps its tensors, here and at the engines: only one a delta may follow."""
        return self._full_pushes_left <= 1

    def hold(self, spec: TensorSpec, tensor: Tensor) -> None:
        """Keep `tensor` (a full push's) as `spec` says it travels."""
        held = self._held.get(spec.name)
        if held is None or held.dtype != spec.dtype or tuple(held.shape) != spec.shape:
            held = self._held[spec.name] = torch.empty(spec.shape, dtype=spec.dtype, device=self._device)
        held.copy_(tensor)

    def diff(self, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, Tensor]], sent: Fingerprints | None,
             covered: frozenset[str]) -> tuple[tuple[tuple[str, int], ...], list[tuple[str, Tensor]]]:
        """Each tensor's (encoding, changed count) against the copy, and its encoded bytes; the copy becomes the new
        values and `sent` gets the fingerprints of the tensors of `covered`, as a full push's would."""
        changes: list[tuple[str, int]] = []
        payloads: list[tuple[str, Tensor]] = []
        for spec, (name, tensor) in zip(specs, tensors, strict=True):
            new = tensor.to(device=self._device, dtype=spec.dtype)
            held = self._held[name]
            mask = delta.changed(held, new)
            count = delta.count(mask)
            encoding = delta.smallest(spec.numel, count, spec.dtype.itemsize)
            if sent is not None and name in covered:
                sent.add(name, new)
            payload = delta.encode(encoding, mask, new) if encoding != delta.DENSE else None
            held.copy_(new)
            changes.append((encoding, count))
            payloads.append((name, delta.encode(delta.DENSE, mask, held) if payload is None else payload))
        return tuple(changes), payloads

    def committed(self, version: int, specs: Sequence[TensorSpec], generation: int, was_delta: bool, *,
                  seconds: float | None = None, full_bytes: int | None = None) -> None:
        """`version` is what the engines hold; `seconds`, what its push took, and `full_bytes`, what it sends whole,
        weigh a delta against a full push."""
        self._version, self._specs, self._generation = version, tuple(specs), generation
        self._deltas_since_anchor = self._deltas_since_anchor + 1 if was_delta else 0
        if seconds is not None and full_bytes:
            self._weigh(was_delta, seconds, full_bytes)

    def _weigh(self, was_delta: bool, seconds: float, full_bytes: int) -> None:
        if not was_delta:
            self._full_seconds_per_byte = seconds / full_bytes
            self._full_pushes_left = max(0, self._full_pushes_left - 1)
            return
        if not self.backoff or self._full_seconds_per_byte is None:
            return
        full_seconds = self._full_seconds_per_byte * full_bytes
        if seconds <= full_seconds:
            self._backoff_now = self.backoff
            return
        self._full_pushes_left = self._backoff_now
        self._slower = (f"a delta push took {seconds:.3f} s, a full one {full_seconds:.3f} s: "
                        f"{self._backoff_now} full pushes before the next delta")
        self._backoff_now = min(2 * self._backoff_now, self.backoff << MAX_BACKOFF_DOUBLINGS)

    @contextlib.contextmanager
    def pushing(self, version: int, delta_sync: bool, checked_by: str = "fingerprints") -> Iterator[None]:
        """Around one push: with delta sync off the copy is freed; a push that does not commit (a failure, a
        mismatch the weight check's `checked_by` found) leaves the engines' weights unknown, so the next is full."""
        if not delta_sync:
            self.drop()
        try:
            yield
        except WeightsDiffer:
            self.forget(f"version {version}'s push was served differently (the {checked_by} differ)")
            raise
        except BaseException as error:
            self.forget(f"version {version}'s push did not commit ({type(error).__name__})")
            raise

    def forget(self, why: str) -> None:
        """The receivers may hold anything else now: the next push is full, and says it repairs `why`."""
        self._version, self._why_full = None, REPAIR + why

    def drop(self) -> None:
        """Delta sync turned off: free the copy."""
        self._held.clear()
        self._version, self._why_full = None, "delta sync was off"


InPlace = Callable[[str], Tensor | None]
"""The engine's live tensor a delta may overwrite for a name, or None (`InferenceEngine.delta_target`)."""


class ReceiverCopy:
    """An engine's side of delta sync, while the sender's manifests say `keep`: a delta goes straight into the
    engine's own tensors where it offers them (`in_place`), and into a kept copy for the rest, whose changed tensors
    are then loaded whole through `load_fn`."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._held: dict[str, Tensor] = {}
        self._loaded = False
        self.version: int | None = None

    @property
    def nbytes(self) -> int:
        """The memory the kept copy takes (nothing for the tensors the engine offers in place)."""
        return sum(tensor.nbytes for tensor in self._held.values())

    def load_fn(self, manifest: Manifest, load_fn: LoadFn, in_place: InPlace | None = None) -> LoadFn:
        """The per-bucket load for `manifest`."""
        self._loaded = False
        if not manifest.keep:
            self._held.clear()
            self.version = None
            return load_fn
        target: InPlace = in_place or (lambda name: None)
        if not manifest.is_delta:
            return lambda named: self._keep(load_fn, list(named), target)
        changes = {spec.name: change for spec, change in zip(manifest.tensors, manifest.changes, strict=True)}
        specs = {spec.name: spec for spec in manifest.tensors}
        base, held_version = manifest.base_version, self.version

        def apply(named: Iterable[tuple[str, Tensor]]) -> None:
            if held_version != base:
                raise ValueError(f"a delta against version {base}, but this engine holds "
                                 f"{'no kept version' if held_version is None else f'version {held_version}'}")
            loaded = []
            for name, payload in named:
                (encoding, count), spec = changes[name], specs[name]
                held = self._held.get(name)
                if held is None:  # the engine's own tensor: in place, nothing to load
                    live = target(name)
                    if live is None or not self._usable(live, spec.dtype, spec.shape):
                        raise ValueError(f"a delta for {name!r}, which neither this engine's weights nor its kept "
                                         f"copy of version {base} hold as {spec.dtype} {list(spec.shape)}")
                    delta.apply(encoding, payload, count, live, spec.dtype)
                    continue
                if held.dtype != spec.dtype or tuple(held.shape) != spec.shape:
                    raise ValueError(f"a delta for {name!r} as {spec.dtype} {list(spec.shape)}, kept as {held.dtype} "
                                     f"{list(held.shape)}")
                delta.apply(encoding, payload, count, held)
                if count or name.endswith(WIRE_SUFFIXES):  # an adapter merges from both its factors
                    loaded.append((name, held))
            if loaded:
                self._load(load_fn, loaded)

        return apply

    def finish(self, manifest: Manifest, load_fn: LoadFn) -> None:
        """After the last bucket of a delta that went wholly in place: an empty load, so the engine still takes the
        version (and drops what it computed with the old weights)."""
        if manifest.is_delta and not self._loaded:
            self._load(load_fn, [])

    def settle(self, manifest: Manifest, loaded: bool) -> None:
        """After the push: the engine and the copy hold `manifest.version` if everything loaded, else unknown."""
        if manifest.keep:
            self.version = manifest.version if loaded else None

    def _load(self, load_fn: LoadFn, named: list[tuple[str, Tensor]]) -> None:
        self._loaded = True
        load_fn(named)

    def _keep(self, load_fn: LoadFn, named: list[tuple[str, Tensor]], target: InPlace) -> None:
        """A full push's bucket: loaded, then a copy kept of each tensor the engine does not offer in place (asked
        after the load, so an engine's tensors made by its first load count)."""
        self._load(load_fn, named)
        for name, tensor in named:
            live = target(name)
            if live is not None and self._usable(live, tensor.dtype, tuple(tensor.shape)):
                self._held.pop(name, None)
                continue
            held = self._held.get(name)
            if held is None or held.dtype != tensor.dtype or held.shape != tensor.shape:
                held = self._held[name] = torch.empty_like(tensor)
            held.copy_(tensor)

    def _usable(self, live: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """A live tensor a delta can be written into exactly: the pushed shape, on this end's device, contiguous,
        in the pushed dtype or a wider float."""
        return (tuple(live.shape) == shape and live.device == self._device and live.is_contiguous()
                and comparable_dtype(dtype, live.dtype))
