"""Samples left out of a trained group (their episode or reward failed): which, and what the log keeps of them."""

from __future__ import annotations

from typing import Any

from bus.episodes import episode_id
from bus.schema import Sample


def failed(sample: Sample) -> bool:
    """No reward to learn from: its episode or its reward failed (a sample the reward worker passed over has none)."""
    return sample.status == "failed" or sample.reward is None


def left_out_entry(sample: Sample) -> dict[str, str]:
    """What the log keeps of a sample left out of its group: which (and its episode), and why."""
    return {"sample_id": sample.sample_id, "episode": episode_id(sample), "error": (sample.error or "no reward")[:300]}


def left_out_episodes(entries: Any) -> int:
    """The episodes an accept record's `left_out` entries name (a log written before episodes: one per entry)."""
    return len({entry.get("episode", entry.get("sample_id")) for entry in entries})
