"""The learner's end of weight transfer: group membership over the bus, bytes through the chosen mechanism.

The learner forms a transfer group of itself and every live rollout worker (a new generation whenever that set
changes or a transfer broke), then for each update sends one `WeightUpdateOrder` per engine over the bus while
its sender moves the tensors. Each engine joins the generation if it is new to it, loads the update through the
loader its order names, and replies; the version counts as committed only when every engine acknowledged it. A
failed transfer is logged and retried at the next update with the engines alive then; the learner's own state
is never touched by it.

The mechanism is chosen once, here (`transport_name`), from the run's configuration; everything after that goes
through `engines.weights.transport`, so this module knows no mechanism by name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from actors.config import RunConfig
from actors.runtime.placement import weight_transport
from bus.schema import Ack, Error, WeightUpdateOrder
from engines.weights.base import GroupHandle, TransferReport, WeightSender, WeightTransferError
from engines.weights.transport import (
    SGLANG,
    TORCH_DISTRIBUTED,
    SenderOptions,
    WeightTransport,
    is_plugin,
    resolve_transport,
)

SENDER_NAME = "learner"
NamedTensors = Iterable[tuple[str, torch.Tensor]]


def transport_name(config: RunConfig) -> str:
    """The mechanism for this run: a `module:attr` in --weight-transport is a plugin; else the engine decides."""
    if is_plugin(config.weights.weight_transport):
        return config.weights.weight_transport
    return SGLANG if config.engine.rollout_engine == "sglang" else TORCH_DISTRIBUTED


def transfer_backend(config: RunConfig) -> str:
    """gloo, nccl or cuda_ipc: as configured, else (auto, or a plugin) by the launcher's rule for this machine.

    The launcher resolves `auto` on the head; a learner started another way decides the same way here.
    """
    if config.weights.weight_transport in ("gloo", "nccl", "cuda_ipc"):
        return config.weights.weight_transport
    return weight_transport(cuda=torch.cuda.is_available(), placement=None)


def sender_options(config: RunConfig, host: str) -> SenderOptions:
    return SenderOptions(
        host=host,
        backend=transfer_backend(config),
        timeout_s=config.weights.weight_transfer_timeout,
        gpus_per_engine=config.engine.rollout_num_gpus_per_engine,
    )


def push_dtype(config: RunConfig) -> torch.dtype | None:
    """With --bf16 the engines serve bfloat16, so the bytes travel as bfloat16 (half of float32's)."""
    return torch.bfloat16 if config.model.bf16 else None


def publisher_for(config: RunConfig, host: str, **wiring: Any) -> WeightPublisher:
    """The run's publisher: its mechanism (a plugin is imported now, so a bad path fails at start-up), the
    sender's options and the push dtype from `config`; `wiring` is the rest of `WeightPublisher`'s arguments."""
    transport = resolve_transport(transport_name(config))
    return WeightPublisher(transport, sender_options(config, host), dtype=push_dtype(config), **wiring)


class WeightPublisher:
    """Pushes versions to the live engines; `committed_version` is the last one every engine acknowledged.

    `engines()` lists the live rollout workers with their rpc endpoints; `tensors()` yields the weights to send
    (a generator is closed after each transfer, so one that holds a lock releases it). The sender is built on
    the first push, from `transport`.
    """

    def __init__(
        self,
        transport: WeightTransport,
        options: SenderOptions,
        *,
        engines: Callable[[], Mapping[str, str]],
        tensors: Callable[[], NamedTensors],
        zmq: Any,
        security: Any,
        client_id: str,
        counters: Any,
        log: Any,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.transport, self.options = transport, options
        self.engines, self.tensors = engines, tensors
        self.zmq, self.security, self.client_id = zmq, security, client_id
        self.counters, self.log, self.dtype = counters, log, dtype
        self.committed_version: int | None = None
        self._sender: WeightSender | None = None
        self._spec: GroupHandle | None = None
        self._clients: dict[str, tuple[str, Any]] = {}

    async def publish(self, version: int) -> bool:
        """Push the learner's current weights as `version`; True once every live engine acknowledged."""
        endpoints = dict(self.engines())
        # Sorted, so an engine's rank in the group (SGLang: its rank_offset) depends only on who is alive.
        engines = sorted(endpoints)
        if not engines:
            return False
        if self._sender is None:
            self._sender = self.transport.make_sender(self.options)
        sender = self._sender
        new_group = self._spec is None or tuple(self._spec.receivers) != tuple(engines)
        if new_group:
            self._spec = sender.open_group([SENDER_NAME, *engines])
        assert self._spec is not None
        group = {**self._spec.to_dict(), "transport": self.transport.name}
        order = WeightUpdateOrder(version=version, group=group, timeout_s=self.options.timeout_s)
        replies = [asyncio.create_task(self._order(engine, endpoints[engine], order)) for engine in engines]
        try:
            if new_group:
                await asyncio.to_thread(sender.wait_for_receivers)
            report = await asyncio.to_thread(self._send, sender, version)
            acks = await asyncio.gather(*replies)
        except WeightTransferError as error:
            self._spec = None  # form a fresh generation next time
            for task in replies:
                task.cancel()
            self.counters["weights.failed"] += 1
            self.log.warning("weight transfer failed; will retry with the live engines", error=str(error))
            return False
        refused = [engine for engine, ok in zip(engines, acks, strict=True) if not ok]
        if refused:
            self._spec = None
            self.log.warning("engines did not acknowledge the update", engines=refused, version=version)
            return False
        self.committed_version = sender.committed_version
        self.counters["weights.pushed"] += 1
        self.log.info(
            "weights pushed",
            version=version,
            engines=len(engines),
            seconds=round(report.seconds, 3),
            mb=round(report.num_bytes / 1e6, 1),
        )
        return True

    def _send(self, sender: WeightSender, version: int) -> TransferReport:
        """In a worker thread: stream the tensors into the sender, and close their generator here too (a
        learner's generator finishes its ranks' collective iteration on close, which must not block the loop)."""
        tensors = self.tensors()
        try:
            return sender.send(tensors, version, dtype=self.dtype)
        finally:
            close = getattr(tensors, "close", None)
            if close is not None:
                close()

    async def _order(self, engine: str, endpoint: str, order: WeightUpdateOrder) -> bool:
        client = self._client(engine, endpoint)
        try:
            reply = await client.call(order, timeout=order.timeout_s * 3, retries=0)
        except Exception as error:
            self.log.warning("weight order unanswered", engine=engine, error=repr(error))
            return False
        if isinstance(reply, Error):
            self.log.warning("engine failed to load weights", engine=engine, detail=reply.detail)
        return isinstance(reply, Ack) and reply.ok

    def _client(self, engine: str, endpoint: str) -> Any:
        from bus import RpcClient

        known = self._clients.get(engine)
        if known is not None and known[0] == endpoint:
            return known[1]
        if known is not None:
            known[1].close()
        client = RpcClient(self.zmq, endpoint, client_id=self.client_id, security=self.security)
        self._clients[engine] = (endpoint, client)
        return client

    def close(self) -> None:
        for _, client in self._clients.values():
            client.close()
        self._clients.clear()
        if self._sender is not None:
            self._sender.close()


def live_engines(members: Iterable[Any]) -> dict[str, str]:
    """Rollout workers (roster members) that serve rpc, by actor id: who a weight push goes to."""
    return {member.actor_id: member.endpoints["rpc"] for member in members if "rpc" in member.endpoints}
