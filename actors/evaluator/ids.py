"""An eval group's id names the round it belongs to: `eval:SET:VERSION:INDEX`.

The round that makes the groups and the round that records their scores read the version and set from the id, so
the format lives here once.
"""

from __future__ import annotations


def eval_group_id(set_name: str, version: int, data_index: int) -> str:
    return f"eval:{set_name}:{version}:{data_index}"


def eval_round_of(group_id: str) -> tuple[int, str] | None:
    """The (version, set) of an eval group's round (None for any other id)."""
    parts = group_id.split(":")
    if len(parts) == 4 and parts[0] == "eval" and parts[2].isdigit():
        return int(parts[2]), parts[1]
    return None


def eval_prompt_of(group_id: str) -> str:
    """The data index of an eval group's prompt, as its id spells it: rounds pair their prompts by it."""
    return group_id.rsplit(":", 1)[1]
