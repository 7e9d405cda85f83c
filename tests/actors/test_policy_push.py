"""A policy's learner pushes its own LoRA adapter, by name: the real Learner of policy "a" (its actor id, its policy's
settings, the torch trainer on the tiny model) pushes over a real gloo group to an engine that loads each order's
adapter by the name the order gives.

The engine here is a torch engine behind the real weight receiver, loading `order.adapter`; it stands in for the
rollout worker's loader, which learns to name adapters in the rollout helper's branch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.handlers import serves
from bus.schema import Ack, Error, WeightUpdateOrder
from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.training.lora import LoraSettings
from engines.weights.group import GroupSpec
from engines.weights.torch_receiver import TorchDistributedWeightReceiver
from tests.support.inprocess import HANG_S, actor_system, write_prompts
from tests.support.policies import start_actor

POLICY = "a"
ADAPTER = LoraSettings(rank=4, alpha=8.0)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
PROMPT = [7, 12, 30, 41, 9]


class AdapterEngine(Actor):
    """Plays a rollout worker's weight loading: joins each order's group, receives the tensors into a torch engine as
    the adapter the order names, and keeps every order it answered."""

    def __init__(self, context: ActorContext) -> None:
        super().__init__(context)
        self.orders: list[WeightUpdateOrder] = []
        self.received: list[list[str]] = []  # the tensor names of each push
        self.receiver: TorchDistributedWeightReceiver | None = None

    async def on_start(self) -> None:
        self.engine = TorchEngine.from_pretrained(self.settings.run.model.hf_checkpoint, lora_scaling=ADAPTER.scaling)

    async def on_stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        await self.engine.close()

    @serves(WeightUpdateOrder)
    async def on_order(self, sender: str, order: WeightUpdateOrder) -> Ack | Error:
        spec = GroupSpec.from_dict(dict(order.group))
        if self.receiver is None or self.receiver.spec.generation != spec.generation:
            self.receiver = await asyncio.to_thread(TorchDistributedWeightReceiver.join, spec, self.actor_id,
                                                    timeout_s=order.timeout_s)
        loop, names = asyncio.get_running_loop(), []

        def load(named: Any) -> None:
            named = list(named)
            names.extend(name for name, _ in named)
            update = self.engine.update_weights(named, order.version, adapter=order.adapter)
            asyncio.run_coroutine_threadsafe(update, loop).result()

        try:
            await asyncio.to_thread(self.receiver.receive, load, order.timeout_s)
        except Exception as error:
            return Error(reason="load_failed", detail=repr(error))
        self.orders.append(order)
        self.received.append(names)
        return Ack(ok=True, error=None)


def _settings(tmp_path: Path, model: Path, policies: dict[str, dict[str, object]]) -> dict[str, object]:
    return {"hf_checkpoint": str(model), "rollout_engine": "torch", "lora_rank": ADAPTER.rank,
            "lora_alpha": ADAPTER.alpha, "weight_transport": "gloo", "weight_transfer_timeout": 30.0,
            "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "policies": policies,
            "use_tensorboard": False, "plots": False}


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_policys_learner_pushes_its_adapter_by_name_as_its_own_sender(tmp_path: Path,
                                                                             tiny_model_path: Path) -> None:
    settings = _settings(tmp_path, tiny_model_path, {POLICY: {}})
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        engine = await start_actor(system, "rollout", AdapterEngine, policy=None)
        learner = await start_actor(system, "learner", "learner", policy=POLICY)
        await system.wait_for(lambda: learner.weights.committed_version == 0, HANG_S, "the learner's first push")

        (order,) = engine.orders
        assert order.adapter == POLICY
        assert GroupSpec.from_dict(dict(order.group)).members == ("learner@a", "rollout-0-0")
        (names,) = engine.received
        assert names and all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in names)
        # What arrived is served as adapter "a" beside the base weights: its slot holds the trainer's factors.
        multi = engine.engine._weights.named_adapters
        assert multi.names == (POLICY,)
        slot = multi._adapters[POLICY].slot
        sent = dict(learner.trainer.local.named_tensors())
        for module, layer in multi._layers.items():
            torch.testing.assert_close(layer.lora_a[slot, :ADAPTER.rank], sent[f"{module}.lora_A.weight"],
                                       rtol=0, atol=0, msg=module)
        (base,) = await engine.engine.generate(GenerateRequest("base", PROMPT, GREEDY))
        (adapted,) = await engine.engine.generate(GenerateRequest("adapted", PROMPT, GREEDY, adapter=POLICY))
        assert list(adapted.output_ids) == list(base.output_ids)  # a fresh adapter (B = 0) computes what the base does
        # The policy's learner writes in its own run directory.
        assert (tmp_path / "policies" / POLICY / "metrics" / "weight_checks.jsonl").is_file()


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_policys_learner_that_finished_ends_its_policy_and_exits_while_the_run_goes_on(
        tmp_path: Path, tiny_model_path: Path) -> None:
    """Policy "a" has nothing to train (num_rollout 0): its learner finishes at once, tells the controller that
    policy "a" finished, and exits; policy "b" has not finished, so the run goes on."""
    settings = _settings(tmp_path, tiny_model_path, {POLICY: {"num_rollout": 0}, "b": {}})
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        await start_actor(system, "rollout", AdapterEngine, policy=None)
        await start_actor(system, "buffer", "buffer", policy=POLICY)
        await start_actor(system, "learner", "learner", policy=POLICY)
        learner_exit = system.tasks["learner@a"]
        await system.wait_for(learner_exit.done, HANG_S, "the learner of policy a to exit")

        controller = system["controller"]
        assert learner_exit.result() == 0
        assert controller.finished.reasons == {POLICY: "trained 0 batches"}
        assert not controller.stopping and controller.run_state == "running"
        assert not system["buffer@a"].stopping and not system["rollout-0-0"].stopping
        assert (tmp_path / "policies" / POLICY / "final_model" / "adapter").is_dir()
