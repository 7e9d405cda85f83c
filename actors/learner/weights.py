"""Weights from the learner to the engines: group membership over the bus, bytes over torch.distributed.

The learner forms a transfer group of itself and every live rollout worker (a new generation whenever that set
changes or a transfer broke), then for each update sends one `WeightUpdateOrder` per engine over the bus while
it broadcasts the tensors. Each engine joins the generation if it is new to it, pauses generation between two
decode steps, loads every bucket in place, resumes, and replies; the version counts as committed only when
every engine acknowledged it. A failed transfer is logged and retried at the next update with the engines that
are alive then; the learner's own state is never touched by it.

With `--rollout-engine sglang` the same flow runs with SGLang's receive side: the learner's sender is
`SglangWeightSender` (a group built the way SGLang builds it, one broadcast per tensor) and each rollout worker
has its SGLang server join the group and receive the buckets over HTTP (`SglangWeightLoader`); the order's
`group` then carries the SGLang group spec (`"kind": "sglang"`) and the worker acknowledges the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from actors.config import RunConfig
from actors.placement import weight_transport
from bus.schema import Ack, Error, WeightUpdateOrder
from engines.sglang.weights import SglangGroupSpec, SglangWeightLoader, SglangWeightSender, is_sglang_group
from engines.weights.base import WeightTransferError
from engines.weights.group import GroupSpec
from engines.weights.torch_distributed import TorchDistributedWeightReceiver, TorchDistributedWeightSender

if TYPE_CHECKING:
    from actors.learner import Learner

SENDER_NAME = "learner"


class LearnerWeightPublisher:
    def __init__(self, learner: Learner, config: RunConfig) -> None:
        self.learner = learner
        self.config = config
        self.log = learner.log
        self._sender: TorchDistributedWeightSender | SglangWeightSender | None = None
        self._spec: GroupSpec | SglangGroupSpec | None = None
        self._clients: dict[str, Any] = {}
        self.committed_version: int | None = None

    async def publish(self, version: int) -> bool:
        """Push the learner's current weights as `version`; True once every live engine acknowledged."""
        # Sorted, so an engine's rank in the group (SGLang: its rank_offset) depends only on who is alive.
        engines = sorted(m.actor_id for m in self.learner.members("rollout") if "rpc" in m.endpoints)
        if not engines:
            return False
        sender = self._ensure_sender()
        new_group = self._spec is None or self._spec.receivers != tuple(engines)
        if new_group:
            self._spec = sender.open_group([SENDER_NAME, *engines])
        spec = self._spec
        assert spec is not None
        order = WeightUpdateOrder(version=version, group=spec.to_dict(), timeout_s=self.config.weight_transfer_timeout)
        replies = [asyncio.create_task(self._order(actor_id, order)) for actor_id in engines]
        try:
            if new_group:
                await asyncio.to_thread(sender.wait_for_receivers)
            named = [(name, tensor.detach()) for name, tensor in self.learner.trainer.named_tensors()]
            report = await asyncio.to_thread(sender.send, named, version, dtype=push_dtype(self.config))
            acks = await asyncio.gather(*replies)
        except WeightTransferError as error:
            self._spec = None  # form a fresh generation next time
            for task in replies:
                task.cancel()
            self.learner.counters["weights.failed"] += 1
            self.log.warning("weight transfer failed; will retry with the live engines", error=str(error))
            return False
        refused = [actor_id for actor_id, ok in zip(engines, acks, strict=True) if not ok]
        if refused:
            self._spec = None
            self.log.warning("engines did not acknowledge the update", engines=refused, version=version)
            return False
        self.committed_version = sender.committed_version
        self.learner.counters["weights.pushed"] += 1
        self.log.info(
            "weights pushed",
            version=version,
            engines=len(engines),
            seconds=round(report.seconds, 3),
            mb=round(report.num_bytes / 1e6, 1),
        )
        return True

    async def _order(self, actor_id: str, order: WeightUpdateOrder) -> bool:
        member = self.learner.roster.get(actor_id)
        if member is None or "rpc" not in member.endpoints:
            return False
        client = self._client(actor_id, member.endpoints["rpc"])
        try:
            reply = await client.call(order, timeout=order.timeout_s * 3, retries=0)
        except Exception as error:
            self.log.warning("weight order unanswered", engine=actor_id, error=repr(error))
            return False
        if isinstance(reply, Error):
            self.log.warning("engine failed to load weights", engine=actor_id, detail=reply.detail)
        return isinstance(reply, Ack) and reply.ok

    def _client(self, actor_id: str, endpoint: str) -> Any:
        from bus import RpcClient

        known = self._clients.get(actor_id)
        if known is not None and known[0] == endpoint:
            return known[1]
        if known is not None:
            known[1].close()
        client = RpcClient(
            self.learner.zmq, endpoint, client_id=f"{self.learner.actor_id}.weights", security=self.learner.security
        )
        self._clients[actor_id] = (endpoint, client)
        return client

    def _ensure_sender(self) -> TorchDistributedWeightSender | SglangWeightSender:
        if self._sender is None:
            backend = transport_of(self.config)
            if self.config.rollout_engine == "sglang":
                self._sender = SglangWeightSender(
                    host=self.learner.context.host,
                    backend=backend,
                    gpus_per_engine=self.config.rollout_num_gpus_per_engine,
                    timeout_s=self.config.weight_transfer_timeout,
                )
                return self._sender
            self._sender = TorchDistributedWeightSender(
                host=self.learner.context.host, backend=backend, timeout_s=self.config.weight_transfer_timeout
            )
        return self._sender

    def close(self) -> None:
        for _, client in self._clients.values():
            client.close()
        if self._sender is not None:
            self._sender.close()


def transport_of(config: RunConfig) -> str:
    """The launcher resolves `auto` on the head; a learner started another way decides the same way here."""
    if config.weight_transport != "auto":
        return config.weight_transport
    return weight_transport(cuda=torch.cuda.is_available(), placement=None)


def push_dtype(config: RunConfig) -> torch.dtype | None:
    """With --bf16 the engines serve bfloat16, so the bytes travel as bfloat16 (half of float32's)."""
    return torch.bfloat16 if config.bf16 else None


class EngineWeightReceiver:
    """The rollout worker's end: joins generations as ordered and loads transfers into its engine."""

    def __init__(self, engine: Any, *, actor_id: str, log: Any) -> None:
        self.engine = engine
        self.actor_id = actor_id
        self.log = log
        self._receiver: TorchDistributedWeightReceiver | None = None
        self._sglang: SglangWeightLoader | None = None
        self._lock = asyncio.Lock()

    async def apply(self, order: WeightUpdateOrder) -> None:
        if is_sglang_group(dict(order.group)):
            async with self._lock:
                if self._sglang is None:
                    self._sglang = SglangWeightLoader(self.engine, self.actor_id)
                await self._sglang.apply(dict(order.group), order.version, order.timeout_s)
                self.log.info(
                    "weights loaded by the SGLang server", version=order.version, group=order.group.get("group_name")
                )
            return
        async with self._lock:
            spec = GroupSpec.from_dict(dict(order.group))
            if (
                self._receiver is None
                or self._receiver.spec.generation != spec.generation
                or self._receiver.spec.port != spec.port
            ):
                self.close()
                self._receiver = await asyncio.to_thread(
                    TorchDistributedWeightReceiver.join, spec, self.actor_id, timeout_s=order.timeout_s
                )
            loop = asyncio.get_running_loop()
            receiver = self._receiver

            def load(named: Iterable[tuple[str, torch.Tensor]]) -> None:
                # The engine copies in place between two decode steps; waiting here keeps the receive buffer
                # alive until it has, and makes the acknowledgement mean "loaded".
                asyncio.run_coroutine_threadsafe(self.engine.update_weights(list(named), order.version), loop).result()

            await self.engine.pause("keep")
            try:
                version = await asyncio.to_thread(receiver.receive, load, order.timeout_s)
            except Exception:
                self.close()
                raise
            finally:
                await self.engine.resume()
            self.log.info("weights loaded", version=version, generation=spec.generation)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
