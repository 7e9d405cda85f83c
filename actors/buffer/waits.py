"""What the buffer reports about itself: what it waits for, in words, for the controller's hang report, and its
gauges for the metrics.

The buffer awaits nothing of its own: it answers requests. But while the learner's batch request is open, the
batch waits for groups, and those groups are leased to named workers: "batch 41: 5 of 8 groups ready; 3 in flight
(rollout-1-0: 2, rollout-0-0: 1)". And a prompt source that admits nothing more explains idle workers: "admission
closed: 24 groups started, 24 allowed until the learner trains batch 3".
"""

from __future__ import annotations

from collections import Counter

from actors.buffer.adoption import adopted_waiting
from actors.buffer.core import BufferCore
from bus.schema import WaitState


def batch_wait(core: BufferCore, batch_id: int, waited_s: float) -> WaitState:
    """The open batch request, and the workers holding the groups it still lacks."""
    holders = Counter(core.leases[lease_id].worker_id for _, lease_id in core.in_flight.values()
                      if lease_id in core.leases)
    held = ", ".join(f"{worker}: {count}" for worker, count in holders.most_common(6))
    wanted = core.admission.groups_per_batch
    words = (f"groups for batch {batch_id}: {min(len(core.pool), wanted)} of {wanted} ready; {len(core.in_flight)} in "
             f"flight{f' ({held})' if held else ''}; {len(core.reissue)} waiting to be re-issued")
    on = holders.most_common(1)[0][0] if holders else "rollout workers"
    return WaitState(on=on, what=words, waited_s=round(waited_s, 3))


def admission_state(core: BufferCore) -> str | None:
    """Why leases come back empty (None while new groups may start or re-issues wait)."""
    window = max(core.learner_version, core.trained_batches)
    allowance = core.admission.capacity(learner_version=window, started_groups=core.live_started)
    if allowance > 0 or core.reissue:
        return None
    return (f"admission closed: {core.live_started} groups started, as many as --max-staleness "
            f"{core.admission.max_staleness} allows until the learner moves past batch {core.trained_batches}")


def gauges(core: BufferCore) -> dict[str, float]:
    """Queue depths and counters: where groups are now, and how many were started, accepted, dropped."""
    return {
        "buffer.pool_groups": float(len(core.pool)),
        "buffer.in_flight_groups": float(len(core.in_flight)),
        "buffer.reissue_queue": float(len(core.reissue)),
        "buffer.started": float(core.stats.started),
        "buffer.accepted": float(core.stats.accepted),
        "buffer.samples_left_out": float(core.stats.left_out_samples),
        "buffer.served_uncommitted": float(len(core.served)),
        "buffer.adopted_waiting": float(adopted_waiting(core)),  # of other policies' episodes, untrained
        **{f"buffer.dropped.{k}": float(v) for k, v in core.stats.dropped.items()},
        **{f"buffer.selection_fallback.{k}": float(v) for k, v in core.stats.selection_fallbacks.items()},
    }
