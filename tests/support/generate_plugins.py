"""Generate functions for the rollout worker's tests, loaded by `--custom-generate-function-path` like a user's."""

from __future__ import annotations

from actors.rollout.generate import RolloutContext, failed_samples
from bus.schema import PromptGroup, Sample


async def always_raises(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """A plugin broken for every prompt (slime's retool plugin before its fix raised so on every sample)."""
    raise RuntimeError(f"tool sandbox unreachable for group {group.group_id}")


async def fails_every_sample(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """Every sample marked failed, as a slime-style plugin that raises comes back (`slime_compat.plugins._failed`):
    the group goes on to the buffer, which drops it, and the next prompt fails the same way."""
    return failed_samples(group, [1, 2], "pkg.retool:generate raised KeyError('tool_call')")
