"""SGLang's LoRA endpoints, beyond the `InferenceEngine` interface: what the adapter loader drives.

A mixin of `SglangEngine`, like `weight_endpoints.py`: loading an adapter by name, unloading one no request uses
any more, and the bookkeeping of which adapter each request in flight named (`_take_adapter` and
`_release_adapter`, called by the engine around every `/generate`). See `adapter_sync.py` for the protocol.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

from engines.sglang import protocol
from engines.sglang.protocol import Endpoint


@dataclass(frozen=True)
class AdapterServing:
    """What a rollout worker needs to hand its server adapters: the run's `lora_alpha` (SGLang scales each
    adapter by `lora_alpha / r`, `r` read from the tensors) and where to write the folders (None: a temporary
    directory; the server must be able to read it)."""

    alpha: float
    folder: str | None = None


class AdapterEndpoints:
    url: str
    _version: int
    _adapter: tuple[str, int] | None  # (name, version) of the adapter new requests run with
    _adapter_users: Counter[str]  # requests in flight per adapter name
    _adapter_released: asyncio.Condition | None

    async def _call(self, endpoint: Endpoint, *, timeout: float | None = None, **fields: Any) -> Any:
        raise NotImplementedError

    @property
    def adapter(self) -> str | None:
        """The name of the LoRA adapter new requests run with; None: the base model."""
        return None if self._adapter is None else self._adapter[0]

    async def load_adapter(self, name: str, path: str, version: int, *, timeout: float | None = None) -> None:
        """Load the PEFT folder `path` on the server as adapter `name`; requests sent from now on run with it and
        their tokens are tagged `version`. Requests already in flight finish with the adapter they named."""
        await self._call(protocol.LOAD_LORA_ADAPTER, timeout=timeout, lora_name=name, lora_path=path)
        self._adapter = (name, version)
        self._version = version

    async def unload_adapter(self, name: str, *, timeout: float) -> None:
        """Drop adapter `name` from the server once no request of this client that named it is in flight.

        Waiting here, not only in SGLang's unload: a request that named the adapter may still be on its way to
        the server, and one that arrives after the unload fails instead of running. TimeoutError after
        `timeout` seconds names the adapter and how many requests still use it."""
        if self.adapter == name:
            raise ValueError(f"{self.url}: adapter {name!r} is the one new requests run with; load its successor "
                             "first")
        released = self._released()
        try:
            async with released:
                await asyncio.wait_for(released.wait_for(lambda: self._adapter_users[name] == 0), timeout)
        except (asyncio.TimeoutError, TimeoutError) as error:
            raise TimeoutError(f"{self.url}: adapter {name!r} still serves {self._adapter_users[name]} requests after "
                               f"{timeout:g}s; not unloaded") from error
        self._adapter_users.pop(name, None)
        await self._call(protocol.UNLOAD_LORA_ADAPTER, timeout=timeout, lora_name=name)

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
