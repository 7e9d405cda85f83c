"""How each rollout worker routes its generate calls over the run's engines (`actors/rollout/router.py`,
docs/router.md)."""

from __future__ import annotations

from pydantic import Field

from actors.config.sections import Section
from policies.routing import RouterPolicy


class RouterConfig(Section):
    """Which engine each generate call goes to: every rollout worker routes its own calls over the engines of every
    rollout worker of the run (docs/router.md)."""

    router_policy: RouterPolicy = Field(
        "affinity", description="affinity: calls keyed alike (an agent episode's session, a group's id) go to one "
        "engine, the key's owner on a consistent-hash ring of the engines, while it is within the load bound, so each "
        "turn reuses the keys and values of the turns before it; keyless calls (the default single turn's) to the "
        "worker's own engine within the bound, else the least loaded. "
        "least-load: every call to the engine with the least outstanding work. round-robin: engines in turn. local: "
        "every call to the worker's own engine (a colocated run's default: its engines hand their memory to the "
        "learner between turns)")
    router_load_slack: float = Field(
        1.0, ge=0, description="affinity's load bound: a keyed call skips its owner for the next engine on the ring "
        "while the owner's outstanding sequences would pass (1 + slack) x the mean; 0 balances strictly (sessions "
        "move more often and prefill again), larger values keep sessions in place under more imbalance")
    router_request_timeout: float = Field(
        3600.0, gt=0, description="seconds a generate call may take, over every engine it is tried on: a call whose "
        "engine dies, leaves or stops goes to the next engine within it (slime: --sglang-router-request-timeout-secs)")
