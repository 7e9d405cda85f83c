"""Episodes on the wire: what a group's `n_samples` count when an episode is a tree of segments.

An agent that rewrites its context (drops old turns, summarises its history, runs a sub-agent with a fresh context)
makes its episode a tree of linear segments, each a `Sample` of its own (`Sample.segment`, `parent_segment`,
`segments`, `ends_episode`); an episode that never did is one sample, segment 0 of 1. Everything that counts a
group's samples in the sense of `n_samples_per_prompt` (the buffer's completeness check, the failed-sample rule,
the prompt accounting, the reward worker, the group baseline, the episode metrics) counts episodes through here, so
a forked episode counts once wherever a sample would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bus.schema import Sample

EpisodeKey = tuple[str, int]  # (group id, the episode's index in its group)


def episode_key(sample: Sample) -> EpisodeKey:
    return sample.group_id, sample.index


def episode_id(sample: Sample) -> str:
    """The episode's id, the sample id of its first segment: f"{group_id}/{index}"."""
    return f"{sample.group_id}/{sample.index}"


def by_episode(samples: Iterable[Sample]) -> dict[EpisodeKey, list[Sample]]:
    """The samples per episode, episodes in the order they first appear, each one's segments in segment order."""
    episodes: dict[EpisodeKey, list[Sample]] = {}
    for sample in samples:
        episodes.setdefault(episode_key(sample), []).append(sample)
    return {key: sorted(segments, key=lambda s: s.segment) for key, segments in episodes.items()}


def count_episodes(samples: Iterable[Sample]) -> int:
    return len({episode_key(sample) for sample in samples})


def final_segment(segments: Sequence[Sample]) -> Sample:
    """The segment that holds the episode's last model turn: the one its reward is computed on."""
    return next((sample for sample in segments if sample.ends_episode), segments[-1])


def final_segments(samples: Iterable[Sample]) -> list[Sample]:
    """One sample per episode, its final segment: what a per-episode quantity (a reward, a pass rate) reads."""
    return [final_segment(segments) for segments in by_episode(samples).values()]


def group_problem(samples: Sequence[Sample], n_episodes: int) -> str | None:
    """What keeps `samples` from being a whole group of `n_episodes` episodes (None when they are one): episodes
    0..n-1 each present once, each with every one of its segments and one final segment."""
    episodes = by_episode(samples)
    indices = sorted(index for _, index in episodes)
    if indices != list(range(n_episodes)):
        return f"episodes {indices}, expected 0..{n_episodes - 1}"
    for (_, index), segments in episodes.items():
        numbers = [sample.segment for sample in segments]
        declared = {sample.segments for sample in segments}
        if declared != {len(segments)} or numbers != list(range(len(segments))):
            return f"episode {index}: segments {numbers} of {sorted(declared)}"
        if sum(sample.ends_episode for sample in segments) != 1:
            return f"episode {index}: {sum(s.ends_episode for s in segments)} segments say they end it, not 1"
    return None
