"""SGLang's LoRA endpoints, beyond the `InferenceEngine` interface: what the adapter loaders drive.

A mixin of `SglangEngine`, like `weight_endpoints.py`: loading an adapter by name, unloading one no request uses
any more, and the bookkeeping of which adapter each request in flight named (`_take_adapter` and
`_release_adapter`, called by the engine around every `/generate`). See `adapter_sync.py` for the protocol.

Adapters are served per policy: a run of one policy has one, under policy None, which every request runs with; a
run of several (`policies:`) has one per policy, and a request naming policy P (`GenerateRequest.adapter`) runs
with P's newest loaded version. Before P's first load its requests run on the base model, at P's version 0, as a
fresh LoRA adapter (B = 0) computes exactly what the base does.

Policies join and leave a running job (docs/multi-policy.md): `serve_adapter` adds one, and `stop_serving` takes one
out as SGLang's own unload does (`TokenizerManager._unload_lora_adapter_locked` in both supported releases: the
name is unregistered at once, so new requests naming it fail, then the unload waits for the requests that hold it).
Here the policy's new requests are refused at once, and the wait also covers its requests still on their way to the
server, which SGLang's count has not seen yet. Until the unload is sent the adapter is still the policy's: a wait
that runs out, or is cancelled because the policy joined again, leaves it loaded, and a join serves it again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from engines.sglang import protocol
from engines.sglang.protocol import Endpoint


@dataclass(frozen=True)
class AdapterServing:
    """What a rollout worker needs to hand its server adapters: the run's `lora_alpha` (SGLang scales each
    adapter by `lora_alpha / r`, `r` read from the tensors), where to write the folders (None: a temporary
    directory; the server must be able to read it), and the run's policies, whose requests name their adapter
    (none: a run of one policy)."""

    alpha: float
    folder: str | None = None
    policies: tuple[str, ...] = ()


class AdapterEndpoints:
    url: str
    _version: int
    adapters: AdapterServing | None
    _served: dict[str | None, tuple[str, int]]  # policy (None: the run's one) -> (name, version) new requests run with
    _left: set[str]  # policies that left the run: their new requests are refused until they join again
    _adapter_users: Counter[str]  # requests in flight per adapter name
    _adapter_released: asyncio.Condition | None

    async def _call(self, endpoint: Endpoint, *, timeout: float | None = None, **fields: Any) -> Any:
        raise NotImplementedError

    async def server_limits(self) -> Any:
        raise NotImplementedError

    @property
    def adapter(self) -> str | None:
        """The name of the LoRA adapter new requests of a run of one policy run with; None: the base model."""
        return self.adapter_name(None)

    def adapter_name(self, policy: str | None) -> str | None:
        """The name on the server of the adapter new requests of `policy` run with; None: the base model."""
        served = self._served.get(policy)
        return None if served is None else served[0]

    def adapter_version(self, policy: str) -> int:
        """The version of `policy`'s adapter new requests of it run with (their tokens carry it); 0 before its first
        load, when they run on the base model (module docstring)."""
        served = self._served.get(policy)
        return 0 if served is None else served[1]

    async def load_adapter(self, name: str, path: str, version: int, *, policy: str | None = None,
                           timeout: float | None = None) -> None:
        """Load the PEFT folder `path` on the server as adapter `name`, version `version` of `policy`'s adapter;
        requests of `policy` sent from now on run with it and their tokens are tagged `version`. Requests already
        in flight, and every other policy's, go on with the adapter they named."""
        await self._call(protocol.LOAD_LORA_ADAPTER, timeout=timeout, lora_name=name, lora_path=path)
        self._served[policy] = (name, version)
        if policy is None:  # a run of one policy: its adapter's version is the engine's
            self._version = version

    async def policy_room(self) -> tuple[int, str] | None:
        """How many policies' adapters the server has room for (`protocol.policies_room`) and why, read from its
        `/server_info`; None when it serves no adapters or does not say. A policy joining the run is checked against
        it: a server attached with --sglang-url has the room it was started with."""
        limits = await self.server_limits() if self.adapters is not None else None
        if limits is None or limits.loras_per_batch is None:
            return None
        flags = f"--max-loras-per-batch {limits.loras_per_batch}" + (
            "" if limits.loaded_loras is None else f", --max-loaded-loras {limits.loaded_loras}")
        room = protocol.policies_room(limits.loras_per_batch, limits.loaded_loras)
        return room, f"SGLang server {self.url} ({flags})"

    def serve_adapter(self, policy: str) -> None:
        """Serve one more policy's adapter (a policy that joined the running job): its requests run on the base
        model until its first load, or with its adapter if it is back before that left the server."""
        if self.adapters is None:
            raise ValueError(f"serve_adapter: adapter {policy!r}: {self.url} serves no adapters (--lora-rank)")
        self._left.discard(policy)
        if policy not in self.adapters.policies:
            self.adapters = dataclasses.replace(self.adapters, policies=(*self.adapters.policies, policy))

    async def stop_serving(self, policy: str, *, timeout: float) -> None:
        """A policy left the run: its new requests are refused from now on, and its adapter leaves the server once
        none of its requests is in flight (module docstring). TimeoutError after `timeout` seconds names the adapter
        and the requests still using it; the adapter then stays loaded."""
        if self.adapters is not None:
            kept = tuple(name for name in self.adapters.policies if name != policy)
            self.adapters = dataclasses.replace(self.adapters, policies=kept)
        self._left.add(policy)
        served = self._served.get(policy)
        if served is None:  # it never loaded one: nothing is on the server
            return
        await self._until_unused(served[0], timeout)
        # A push that landed meanwhile made a newer adapter current (its loader retires the one waited for); no
        # request can have named the newer one, so it leaves now.
        current = self._served.pop(policy, None)
        if current is not None:
            await self._call(protocol.UNLOAD_LORA_ADAPTER, timeout=timeout, lora_name=current[0])

    async def unload_adapter(self, name: str, *, timeout: float) -> None:
        """Drop adapter `name` from the server once no request of this client that named it is in flight.

        Waiting here, not only in SGLang's unload: a request that named the adapter may still be on its way to
        the server, and one that arrives after the unload fails instead of running. TimeoutError after
        `timeout` seconds names the adapter and how many requests still use it."""
        current = [policy for policy, (served, _) in self._served.items() if served == name]
        if current:
            whose = "" if current[0] is None else f" of policy {current[0]!r}"
            raise ValueError(f"{self.url}: adapter {name!r} is the one new requests{whose} run with; load its "
                             "successor first")
        await self._until_unused(name, timeout)
        await self._call(protocol.UNLOAD_LORA_ADAPTER, timeout=timeout, lora_name=name)

    async def _until_unused(self, name: str, timeout: float) -> None:
        """Until no request of this client that named adapter `name` is in flight; TimeoutError after `timeout`."""
        released = self._released()
        try:
            async with released:
                await asyncio.wait_for(released.wait_for(lambda: self._adapter_users[name] == 0), timeout)
        except (asyncio.TimeoutError, TimeoutError) as error:
            raise TimeoutError(f"{self.url}: adapter {name!r} still serves {self._adapter_users[name]} requests after "
                               f"{timeout:g}s; not unloaded") from error
        self._adapter_users.pop(name, None)

    def _served_adapter(self, request_id: str, policy: str | None) -> tuple[str, int] | None:
        """The (name, version) a request of `policy` runs with now; None: the base model. A request naming a
        policy this engine serves no adapter for is refused, naming what it serves."""
        if policy is not None:
            if self.adapters is None:
                raise ValueError(f"request {request_id!r}: adapter {policy!r}: {self.url} serves no adapters (the "
                                 "run trains none: --lora-rank)")
            if policy in self._left:
                raise ValueError(f"request {request_id!r}: policy {policy!r} left the run: {self.url} serves its "
                                 "adapter no more")
            if policy not in self.adapters.policies and policy not in self._served:
                raise ValueError(f"request {request_id!r}: adapter {policy!r} is not one {self.url} serves (its "
                                 f"policies: {list(self.adapters.policies)})")
        return self._served.get(policy)

    def _take_adapter(self, adapter: tuple[str, int] | None) -> None:
        if adapter is not None:
            self._adapter_users[adapter[0]] += 1

    async def _release_adapter(self, adapter: tuple[str, int] | None) -> None:
        if adapter is None:
            return
        self._adapter_users[adapter[0]] -= 1
        released = self._released()
        async with released:
            released.notify_all()

    def _released(self) -> asyncio.Condition:
        # Created on first use, inside the loop that uses it (the engine may be built in a worker thread).
        if self._adapter_released is None:
            self._adapter_released = asyncio.Condition()
        return self._adapter_released
