"""The two context-parallel helpers of slime's mismatch (TIS/MIS) plugin: ``slime.backends.megatron_utils.cp_utils``.

slime hands a TIS function each rank's slice of a row split across context-parallel ranks, and the function gathers
and re-slices it with these. Here a row split across ranks is the training engine's business alone (docs/DESIGN.md,
"Long rows"): a TIS function always sees whole rows, so both helpers are what slime's are at one CP rank, the
identity (the slice checks its length as slime's does).
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["all_gather_with_cp", "slice_log_prob_with_cp"]

T = TypeVar("T")


def all_gather_with_cp(tensor: T, total_length: int, response_length: int) -> T:
    """A row's per-response-token values, whole: they were never split."""
    return tensor


def slice_log_prob_with_cp(log_prob: T, total_length: int, response_length: int) -> T:
    """This rank's part of a row's response log-probs: all of them."""
    if len(log_prob) != response_length:  # type: ignore[arg-type]
        raise ValueError(f"slice_log_prob_with_cp: {len(log_prob)} log-probs for a response of "  # type: ignore[arg-type]
                         f"{response_length} tokens (total length {total_length})")
    return log_prob
