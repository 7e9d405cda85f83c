"""Learning-rate schedules as pure functions of the policy version.

The multiplier depends only on how many optimizer steps were applied (the version), so a resumed run needs no
scheduler state in its checkpoint and skipped steps (non-finite loss) do not advance the schedule.
"""

from __future__ import annotations

import math
from typing import Literal


def lr_multiplier(
    step: int,
    *,
    schedule: Literal["constant", "cosine"],
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the peak learning rate for the update that turns version `step` into `step + 1`.

    Warmup is linear and starts above zero ((step + 1) / warmup_steps) so the very first update moves the
    weights; cosine decays from 1 at the end of warmup to `min_lr_ratio` at `total_steps` and stays there.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r}; choose 'constant' or 'cosine'")
    if total_steps is None or total_steps <= warmup_steps:
        raise ValueError(f"cosine schedule needs total_steps > warmup_steps, got {total_steps} <= {warmup_steps}")
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
