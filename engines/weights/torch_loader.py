"""The engine side of the bucketed torch.distributed broadcast: join each generation, load each transfer.

The engine pauses between two decode steps for the receive ("keep": requests in flight continue afterwards with
the new weights) and resumes whatever happens, so a failed transfer never leaves generation stopped. A checked push
resumes it as soon as the weights are in, before the engine fingerprints them: the fingerprint reads beside
generation what generation now uses, and the engine keeps any load from writing the weights meanwhile
(`engines/inference/served_weights.py`), so the check costs generation no pause. Any
failure drops the receiver: the learner forms a new generation and this loader joins it at the next order. An
order for an older generation than the one joined (it arrived late) is refused without touching the receiver.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

from engines.weights.base import WeightTransferError
from engines.weights.fingerprint import FingerprintPlan, ServedPrints
from engines.weights.group import GroupSpec
from engines.weights.manifest import TensorSpec
from engines.weights.torch_receiver import TorchDistributedWeightReceiver


class TorchDistributedLoader:
    def __init__(self, engine: Any, actor_id: str, log: Any,
                 receiver_class: type[TorchDistributedWeightReceiver] = TorchDistributedWeightReceiver) -> None:
        """`receiver_class`: the protocol's receiver, or one that takes the bytes another way (`disk.py`)."""
        self.receiver_class = receiver_class
        self.engine = engine
        self.actor_id = actor_id
        self.log = log
        self._receiver: TorchDistributedWeightReceiver | None = None

    async def apply(self, group: Mapping[str, Any], version: int, timeout_s: float, *,
                    adapter: str | None = None) -> None:
        """Join `group`'s generation if it is new to us, then receive `version` into the engine: into its named
        adapter `adapter` (a policy's, the others untouched) or, with None, into its own weights."""
        spec = GroupSpec.from_dict(dict(group))
        receiver = self._receiver
        if receiver is not None and receiver.spec.port == spec.port and spec.generation < receiver.spec.generation:
            # A late order of a generation the learner already replaced: joining it would only drop the current one.
            raise WeightTransferError(
                f"{self.actor_id}: order for generation {spec.generation} arrived after generation "
                f"{receiver.spec.generation}'s"
            )
        if receiver is None or receiver.spec.generation != spec.generation or receiver.spec.port != spec.port:
            self._drop_receiver()
            receiver = await asyncio.to_thread(
                self.receiver_class.join, spec, self.actor_id, timeout_s=timeout_s
            )
            self._receiver = receiver
        try:
            await self._receive(receiver, version, timeout_s, adapter)
        except Exception:
            self._drop_receiver()
            raise

    async def _receive(self, receiver: TorchDistributedWeightReceiver, version: int, timeout_s: float,
                       adapter: str | None) -> int:
        """One transfer into the engine; returns the version received."""
        loop = asyncio.get_running_loop()

        def load(named: Iterable[tuple[str, Tensor]]) -> None:
            # The engine copies in place between two decode steps; waiting here keeps the receive buffer alive
            # until it has, and makes the acknowledgement mean "loaded".
            update = (self.engine.update_weights(list(named), version) if adapter is None else
                      self.engine.update_weights(list(named), version, adapter=adapter))
            asyncio.run_coroutine_threadsafe(update, loop).result()

        resumed: list[float] = []  # when generation resumed, once

        def resume() -> None:
            if not resumed:
                asyncio.run_coroutine_threadsafe(self.engine.resume(), loop).result()
                resumed.append(time.perf_counter())

        def fingerprint(specs: tuple[TensorSpec, ...], plan: FingerprintPlan) -> ServedPrints | None:
            resume()  # every bucket is loaded: generation goes on with them while they are fingerprinted
            served = (self.engine.served_fingerprints(specs, plan) if adapter is None else
                      self.engine.served_fingerprints(specs, plan, adapter=adapter))
            return asyncio.run_coroutine_threadsafe(served, loop).result()

        await self.engine.pause("keep")
        paused = time.perf_counter()
        try:
            # A delta overwrites the engine's own weights where it offers them (paused, so no step sees half of it).
            in_place = self.engine.delta_target if adapter is None else None
            received = await asyncio.to_thread(receiver.receive, load, timeout_s, fingerprint_fn=fingerprint,
                                               in_place=in_place)
        finally:
            if not resumed:
                await self.engine.resume()
                resumed.append(time.perf_counter())
        paused_ms = round(1000 * (resumed[0] - paused), 2)  # what generation waited for: the receive and the loads
        if adapter is None:
            self.log.info("weights loaded", version=received, generation=receiver.spec.generation, paused_ms=paused_ms)
        else:
            self.log.info("weights loaded", version=received, generation=receiver.spec.generation, adapter=adapter,
                          paused_ms=paused_ms)
        return received

    def _drop_receiver(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def close(self) -> None:
        self._drop_receiver()
