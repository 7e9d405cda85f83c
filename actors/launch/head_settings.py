"""A worker node joins a run with the head's address alone: its launcher asks the head for the run's settings.

The head's controller answers `RunConfigQuery` with the settings every actor of the run was given, by section as
RUN_DIR/config.yaml holds them (the weight transport already resolved by the head). The worker's own `--config`
file and flags then override them, for what is the node's own business. Two settings are never taken from the
head, because they describe the head's node: the GPUs a node may use and the SGLang servers its rollout workers
attach to (`NODE_LOCAL`). Paths are the head's: the same on every node (a shared filesystem), or given again.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

NODE_LOCAL: dict[str, tuple[str, ...]] = {"placement": ("num_gpus_per_node",), "engine": ("sglang_url",)}
ATTEMPT_S = 2.0


class HeadSettingsError(RuntimeError):
    """The head did not give the run's settings; the message names the head and why."""


def fetch_head_settings(head_address: str, *, node_rank: int, curve_keys: Path | None,
                        timeout: float) -> dict[str, Any]:
    """The run's settings from the controller at `head_address`, less the node-local ones; blocking."""
    settings = asyncio.run(_ask(head_address, node_rank=node_rank, curve_keys=curve_keys, timeout=timeout))
    return {section: ({k: v for k, v in values.items() if k not in NODE_LOCAL.get(section, ())}
                      if isinstance(values, dict) else values)
            for section, values in settings.items()}


async def _ask(head_address: str, *, node_rank: int, curve_keys: Path | None, timeout: float) -> dict[str, Any]:
    import zmq.asyncio

    from bus import RpcClient, RpcTimeout, Security
    from bus.schema import RunConfigQuery, RunConfigReply

    context = zmq.asyncio.Context()
    security = Security.from_directory(curve_keys) if curve_keys is not None else None
    client = RpcClient(context, head_address, client_id=f"launcher-{node_rank}-{os.getpid()}", security=security)
    try:
        # The head's launcher may still be starting its controller: one short attempt after another until timeout.
        reply = await client.call(RunConfigQuery(node_rank=node_rank), timeout=ATTEMPT_S,
                                  retries=max(0, int(timeout / ATTEMPT_S) - 1))
    except RpcTimeout:
        # With CURVE, a head holding other keys refuses the handshake: that looks exactly like no head at all.
        same_keys = f", with the same keys as {curve_keys}" if curve_keys is not None else ""
        raise HeadSettingsError(f"head {head_address} did not give the run's settings within {timeout:.0f}s (is "
                                f"its controller running{same_keys}?)") from None
    finally:
        client.close()
        context.destroy(linger=0)
    if not isinstance(reply, RunConfigReply):
        raise HeadSettingsError(f"head {head_address} did not give the run's settings: {reply!r}")
    return dict(reply.settings)
