"""The two hooks slime's default rollout function calls on each finished rollout, made ours.

``--rollout-sample-filter-path`` ``fn(args, groups)``: slime calls it on the groups a rollout keeps (after the
dynamic filter), and the function marks samples ``remove_sample = True``; slime then trains nothing of them (their
loss masks become zeros) but leaves them in their groups, so they still count in the group's reward
normalisation. Here the learner calls it on each batch's groups before anything else touches the batch (the
train-data conversion and reward post-process included, which see the mark, as slime's do), and a marked sample
trains with an all-zero loss mask; its ``remove_sample`` travels in its metadata (``REMOVED``), so a recording shows
it. The samples are slime-shaped copies: what else the function changes is not read.

``--rollout-all-samples-process-path`` ``fn(args, all_groups, data_source)``: slime calls it with every group
generated for the rollout, those its dynamic filter dropped included. Here the buffer applies that filter, so the
buffer calls it once per training batch, when the batch is first assembled: the batch's groups and every group
dropped since the previous batch (by the dynamic filter, or for failed samples or a non-finite reward), sorted by
prompt as slime sorts them. slime's ``data_source`` (its ``get_samples``, which would take more prompts) cannot be
given: the buffer's prompt cursor is not the hook's to move, so the function gets a stand-in that says so when
called. The dropped groups a buffer holds when it restarts are not kept; the hook sees the groups dropped after.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from actors.config import RunConfig
from actors.slime_compat.args import build_args
from actors.slime_compat.sample import REMOVED, Sample, from_wire
from bus.schema import Sample as WireSample
from bus.schema import ScoredGroup
from policies.plugins import load_callable

__all__ = ["ALL_SAMPLES_FLAG", "FILTER_FLAG", "AllSamplesProcess", "NoDataSource", "SampleFilter",
           "load_all_samples_process", "load_sample_filter"]

FILTER_FLAG = "--rollout-sample-filter-path"
ALL_SAMPLES_FLAG = "--rollout-all-samples-process-path"


def load_sample_filter(config: RunConfig) -> SampleFilter | None:
    path = config.learner.rollout_sample_filter_path
    if not path:
        return None
    fn = _loaded(path, FILTER_FLAG, "fn(args, groups)", 2)
    return SampleFilter(fn=fn, args=build_args(config), path=path)


def load_all_samples_process(config: RunConfig) -> AllSamplesProcess | None:
    path = config.buffer.rollout_all_samples_process_path
    if not path:
        return None
    fn = _loaded(path, ALL_SAMPLES_FLAG, "fn(args, all_groups, data_source)", 3)
    return AllSamplesProcess(fn=fn, args=build_args(config), path=path)


def _loaded(path: str, flag: str, signature: str, arity: int) -> Callable[..., Any]:
    fn = load_callable(path, what=flag)
    try:
        inspect.signature(fn).bind(*([None] * arity))
    except TypeError as error:
        raise TypeError(f"{flag} {path!r}: expected slime's signature {signature} ({error})") from None
    except ValueError:
        pass  # a builtin without a signature: trust it
    return fn


@dataclass(frozen=True)
class SampleFilter:
    """The batch's samples in, the same samples out, those the function marked with an all-zero loss mask."""

    fn: Callable[..., Any]
    args: Any
    path: str

    def __call__(self, samples: list[WireSample]) -> list[WireSample]:
        offered = [from_wire(sample) for sample in samples]
        groups: dict[str, list[Sample]] = {}
        for wire, sample in zip(samples, offered, strict=True):
            groups.setdefault(wire.group_id, []).append(sample)
        self.fn(self.args, list(groups.values()))
        kept = list(samples)
        for position, (wire, sample) in enumerate(zip(samples, offered, strict=True)):
            if not isinstance(sample.remove_sample, bool | np.bool_):
                raise TypeError(f"{FILTER_FLAG} {self.path!r}: set remove_sample of sample {wire.sample_id} to "
                                f"{sample.remove_sample!r}; expected True or False")
            if sample.remove_sample:
                kept[position] = msgspec.structs.replace(
                    wire, loss_mask=np.zeros(wire.response_length, dtype=np.int8),
                    metadata={**wire.metadata, REMOVED: True})
        return kept


class NoDataSource:
    """What the all-samples hook receives as slime's ``data_source``: calling it (or its ``get_samples`` /
    ``add_samples``) raises, saying why, instead of taking prompts out of the buffer's order."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{ALL_SAMPLES_FLAG}: slime's data_source is not available to the hook here: the buffer "
                           "owns the prompt cursor and serves prompts only to rollout workers")

    get_samples = add_samples = __call__


@dataclass
class AllSamplesProcess:
    """The buffer's `GeneratedGroupsHook` around the function: drops are kept until the next batch is assembled."""

    fn: Callable[..., Any]
    args: Any
    path: str
    pending: list[ScoredGroup] = field(default_factory=list)

    def dropped(self, group: ScoredGroup, reason: str) -> None:
        self.pending.append(group)

    def assembled(self, batch_id: int, groups: Sequence[ScoredGroup]) -> None:
        every, self.pending = [*groups, *self.pending], []
        all_groups = [[from_wire(sample) for sample in group.samples] for group in every if group.samples]
        all_groups.sort(key=lambda group: group[0].group_index or 0)
        self.fn(self.args, all_groups, NoDataSource())
