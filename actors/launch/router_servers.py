"""`--sglang-router-url` (slime's `--sglang-router-ip/--sglang-router-port`): the servers registered with a router
become the run's attached SGLang servers, as if given with `--sglang-url`.

The head's launcher asks the router once, before it counts its actors, so it starts one rollout worker per server
(`default_rollout_workers`) and every actor's settings name the servers themselves: the router is out of the way
from then on. Servers that join the router later are not used, and one that leaves is a rollout worker whose engine
fails, as with `--sglang-url`; re-reading the list mid-run would need rollout workers to come and go with it. Another
node given the same router (a scheduler runs one command everywhere) starts no rollout worker for it: the head's
workers already attach to every server.
"""

from __future__ import annotations

import sys

from actors.config import RunConfig
from actors.launch.node_roles import LaunchError
from engines.sglang.router_workers import RouterWorkersError, router_servers


def attach_router_servers(config: RunConfig, *, head: bool, rollout_workers: int | None) -> RunConfig:
    """`config` with the router's servers as `sglang_url` (on the head), unchanged without a router.
    `rollout_workers`: the node's --rollout-workers, when given."""
    router = config.engine.sglang_router_url
    if router is None:
        return config
    if not head:
        if rollout_workers:
            raise LaunchError(f"--rollout-workers {rollout_workers} with --sglang-router-url {router} on a node "
                              "other than the head: the head's rollout workers attach to every server the router "
                              "lists; give this node's own servers with --sglang-url instead")
        return config
    try:
        servers = router_servers(router, timeout=config.engine.sglang_router_timeout)
    except RouterWorkersError as error:
        raise LaunchError(str(error)) from None
    if rollout_workers is not None and rollout_workers > len(servers.urls):
        raise LaunchError(f"--rollout-workers {rollout_workers}, but sglang-router {router} lists "
                          f"{len(servers.urls)} server(s) ({', '.join(servers.urls)}): one rollout worker attaches to "
                          "each server")
    left_out = f"; left out as unhealthy: {', '.join(servers.unhealthy)}" if servers.unhealthy else ""
    print(f"launcher.py: sglang-router {router} lists {len(servers.urls)} SGLang server(s), attached as --sglang-url "
          f"{' '.join(servers.urls)}{left_out}", file=sys.stderr)
    return config.with_settings(sglang_router_url=None, sglang_url=servers.urls)
