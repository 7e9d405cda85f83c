"""The rollout worker's end of weight transfer: one loader per mechanism and sender, picked by each order's group.

The learner's sender names its mechanism in every group spec (`order.group["transport"]`) and itself as the group's
first member; the loader for that pair is built on first use and kept, since it holds the group it joined. A run of
several policies has a learner per policy, each pushing its own adapter (`order.adapter`) in its own group, so each
gets its own loader. Orders are applied one at a time, whoever sent them: two loads racing into one engine would
leave it serving a mix of versions.

A plugin mechanism is loaded only if it is the one this run was configured with (`--weight-transport
module:attr`): an order names code to import, so a worker never imports a path it was not told to expect.
Torch is imported only by the mechanisms that use it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bus.schema import WeightUpdateOrder
from engines.weights.transport import BUILTIN, EngineLoader, is_plugin, resolve_transport


class EngineWeightReceiver:
    def __init__(self, engine: Any, *, actor_id: str, log: Any, plugin: str | None = None) -> None:
        self.engine = engine
        self.actor_id = actor_id
        self.log = log
        self._accepted = set(BUILTIN) | ({plugin} if plugin is not None and is_plugin(plugin) else set())
        self._loaders: dict[tuple[str, str | None], EngineLoader] = {}  # (transport, sender) -> its loader
        self._lock = asyncio.Lock()

    async def apply(self, order: WeightUpdateOrder) -> None:
        """Load `order.version` through the order's mechanism, into `order.adapter` where it names one; raises what
        the loader raised."""
        async with self._lock:
            loader = await self._loader(order)
            if order.adapter is None:
                await loader.apply(dict(order.group), order.version, order.timeout_s)
            else:
                await loader.apply(dict(order.group), order.version, order.timeout_s,  # type: ignore[call-arg]
                                   adapter=order.adapter)

    async def _loader(self, order: WeightUpdateOrder) -> EngineLoader:
        name = order.group.get("transport")
        if not isinstance(name, str) or name not in self._accepted:
            raise ValueError(
                f"weight update order for version {order.version}: transport {name!r} is not one this worker "
                f"accepts ({sorted(self._accepted)})"
            )
        members = order.group.get("members")
        sender = members[0] if isinstance(members, (list, tuple)) and members and isinstance(members[0], str) else None
        if order.adapter is not None and not resolve_transport(name).named_adapters:
            raise ValueError(f"weight update order for version {order.version} from {sender or 'the learner'}: "
                             f"adapter {order.adapter!r}: the {name} transport cannot load a named adapter")
        loader = self._loaders.get((name, sender))
        if loader is None:
            # Built in a thread: the first build imports its mechanism (torch, for a worker whose engine never
            # needed it), seconds on a busy machine, during which the worker's heartbeats must keep going or the
            # controller declares it dead.
            loader = self._loaders[name, sender] = await asyncio.to_thread(self._build_loader, name)
        return loader

    def _build_loader(self, name: str) -> EngineLoader:
        return resolve_transport(name).make_loader(self.engine, self.actor_id, self.log)

    def close(self) -> None:
        for loader in self._loaders.values():
            loader.close()
        self._loaders.clear()
