"""What a group with failed samples trains on: the rule the buffer applies and the reward worker scores by.

A sample fails when its episode raised, overran its timeout or did not fit the context, or when its reward could
not be computed: it has no reward to learn from. `leave_out` (the default) trains the group on its other samples,
with advantages normalised over them, while at least `MIN_SAMPLES_LEFT` remain (fewer leave no baseline for a group
estimator); the samples left out are counted (`buffer.samples_left_out`, `rollout/samples_left_out`) and logged,
so the run's certificate accounts for each. `drop_group` drops the whole group, as every group with a failed
sample was before.

What the rule counts is episodes: an agent's episode that rewrote its context is several samples (segments,
`bus.episodes`); it fails when any of its segments does, and is left out whole, and the 2 that must remain are 2
episodes, however many segments they have.

Neither invents a reward for the failed sample. slime's agent examples keep it in the group with reward 0 and no
loss (`remove_sample`): its zero then moves the others' baseline, which rewards them for a failure that was not
theirs. An agent whose failure is the model's doing (a call it cannot parse, a loop it never leaves) should catch
it and return what the reward needs to score it low, rather than raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from bus.episodes import by_episode, episode_key

if TYPE_CHECKING:
    from bus.schema import Sample

FailedSamplePolicy = Literal["leave_out", "drop_group"]
MIN_SAMPLES_LEFT = 2


def samples_to_train(samples: Sequence[Sample], policy: FailedSamplePolicy,
                     failed: Callable[[Sample], bool]) -> list[Sample] | None:
    """The samples of a group that train: all when none `failed`, the other episodes' when `policy` leaves failed
    episodes out and enough remain; None when the group is dropped."""
    episodes = by_episode(samples)
    kept = {key for key, segments in episodes.items() if not any(failed(sample) for sample in segments)}
    if len(kept) == len(episodes):
        return list(samples)
    if policy == "drop_group" or len(kept) < MIN_SAMPLES_LEFT:
        return None
    return [sample for sample in samples if episode_key(sample) in kept]
