"""A push's tensors as a stream the sender pulls bucket by bucket, their specs known before the first one exists.

Every transfer starts with its manifest: each tensor's name, dtype and shape, before any bytes move. A sender
handed a bare iterable must therefore pull every tensor before it sends the first, and a source that makes its
tensors as it goes (the Megatron backend gathers each tensor-parallel shard set and converts it to HF layout)
then holds the whole gathered model at once: 140 GB in bf16 for a 70B model, on top of the training state.

A model's tensor names, dtypes and shapes do not change within a run. So the learner records them once
(`record_specs`, one pass that keeps nothing) and hands later pushes a `SpecifiedTensors`: the sender builds the
manifest from the specs and pulls each tensor only when its bucket goes out, so a push holds the buckets in
flight, not the model. A source that then yields something else (a different name, shape or dtype, too few or
too many tensors) or raises mid-way ends the transfer with `SourceBroke`, and the learner records the specs
again before its next push.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.weights.manifest import TensorSpec


class SourceBroke(Exception):
    """The tensors a push streams stopped matching their recorded specs, or their source raised.

    Deliberately not a RuntimeError: the senders treat RuntimeError as a failed collective, and this is the
    learner's own side failing, which no receiver is to blame for."""


def spec_of(name: str, tensor: Tensor) -> TensorSpec:
    return TensorSpec(name, tensor.dtype, tuple(tensor.shape))


def record_specs(named_tensors: Iterable[tuple[str, Tensor]]) -> tuple[TensorSpec, ...]:
    """One pass over `named_tensors` that keeps each tensor's spec and drops the tensor; names must be unique."""
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    try:
        for name, tensor in named_tensors:
            if name in seen:
                raise ValueError(f"weight transfer: tensor name {name!r} appears twice")
            seen.add(name)
            specs.append(spec_of(name, tensor))
            del tensor  # before the source makes the next one
    finally:
        close = getattr(named_tensors, "close", None)
        if close is not None:
            close()
    return tuple(specs)


def wire_specs(specs: Sequence[TensorSpec], dtype: torch.dtype | None) -> tuple[TensorSpec, ...]:
    """The specs as they travel: floating tensors cast to `dtype` when one is given, the rest as they are."""
    if dtype is None:
        return tuple(specs)
    return tuple(TensorSpec(s.name, dtype, s.shape) if s.dtype.is_floating_point else s for s in specs)


@dataclass(frozen=True)
class SpecifiedTensors:
    """`source`'s (name, tensor) pairs, which must match `specs` one for one, in order.

    Iterating checks each pair as it is pulled, raising SourceBroke at the first that does not match, when the
    source ends early or raises, and, once every spec was met, when it has more. Iterate it once."""

    specs: tuple[TensorSpec, ...]
    source: Iterable[tuple[str, Tensor]]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        source, total = iter(self.source), len(self.specs)
        for position, spec in enumerate(self.specs):
            where = f"tensor {position + 1} of {total} ({spec.name!r})"
            try:
                name, tensor = next(source)
            except StopIteration:
                raise SourceBroke(f"the learner's tensors ended before {where}") from None
            except Exception as error:
                raise SourceBroke(f"the learner's tensors failed at {where}: {error!r}") from error
            if spec_of(name, tensor) != spec:
                got = spec_of(name, tensor)
                raise SourceBroke(
                    f"{where}: recorded as {spec.dtype} {list(spec.shape)}, the source yields {got.name!r} "
                    f"{got.dtype} {list(got.shape)}"
                )
            yield name, tensor.detach()
        try:
            extra = next(source, None)
        except Exception as error:
            raise SourceBroke(f"the learner's tensors failed after the last recorded one: {error!r}") from error
        if extra is not None:
            raise SourceBroke(f"the learner's tensors go on past the {total} recorded: {extra[0]!r} is new")

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


def specified(named_tensors: Iterable[tuple[str, Tensor]]) -> SpecifiedTensors:
    """`named_tensors` as a SpecifiedTensors: itself if it is one, else listed (references only, no copies) so
    its specs are known before anything is sent. A bare iterable is therefore held whole during the push."""
    if isinstance(named_tensors, SpecifiedTensors):
        return named_tensors
    listed = [(name, tensor.detach()) for name, tensor in named_tensors]
    names = [name for name, _ in listed]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"weight transfer: tensor name {duplicate!r} appears twice")
    return SpecifiedTensors(tuple(spec_of(name, tensor) for name, tensor in listed), listed)
