"""Two learners (a run of two policies) push their adapters to one torch engine over real gloo groups: the rollout
worker's receiver keeps one group per sender, applies their orders one at a time, and each push lands on its own
adapter at its own version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog
import torch
from transformers import AutoModelForCausalLM

from actors.rollout.weights import EngineWeightReceiver
from bus.schema import WeightUpdateOrder
from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.weights.base import WeightSender
from engines.weights.transport import SenderOptions, resolve_transport
from tests.support.adapters import random_adapter

pytestmark = pytest.mark.integration
SCALING = 2.0
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


async def _push(receiver: EngineWeightReceiver, sender: WeightSender, group: dict[str, object],
                tensors: list[tuple[str, torch.Tensor]], version: int, adapter: str, *, new_group: bool) -> None:
    """What a learner does: the order to the worker, and the broadcast once the worker has joined (a new group) or at
    once (the group it formed at an earlier push)."""
    order = WeightUpdateOrder(version=version, group=group, timeout_s=30.0, adapter=adapter)
    loading = asyncio.create_task(receiver.apply(order))
    if new_group:
        await asyncio.to_thread(sender.wait_for_receivers)
    await asyncio.to_thread(sender.send, iter(tensors), version)
    await loading


async def _outputs(engine: TorchEngine, adapter: str) -> tuple[list[int], set[int]]:
    (output,) = await engine.generate(GenerateRequest(f"r-{adapter}", PROMPT, GREEDY, adapter=adapter))
    return list(output.output_ids), set(output.versions)


async def test_two_learners_push_their_own_adapters_into_one_engine_each_in_its_own_group(
        tiny_model_path: Path) -> None:
    transport = resolve_transport("torch_distributed")
    senders = {policy: transport.make_sender(SenderOptions(host="127.0.0.1", backend="gloo", timeout_s=30.0))
               for policy in ("a", "b")}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    engine = TorchEngine(model, None, lora_scaling=SCALING, adapters=("a", "b"))
    reference = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), None,
                            lora_scaling=SCALING)
    receiver = EngineWeightReceiver(engine, actor_id="rollout-0", log=structlog.get_logger())
    adapters = {(policy, seed): random_adapter(model, 4, seed, scale=0.5) for policy, seed in
                (("a", 1), ("b", 2), ("a", 3))}
    try:
        groups = {policy: sender.open_group([f"learner@{policy}", "rollout-0"]).to_dict()
                  for policy, sender in senders.items()}
        # both at once: the worker applies one order, then the other
        # both at once: the worker applies one order, then the other
        await asyncio.gather(_push(receiver, senders["a"], groups["a"], adapters["a", 1], 1, "a", new_group=True),
                             _push(receiver, senders["b"], groups["b"], adapters["b", 2], 5, "b", new_group=True))
        # a's next push goes over the group a formed, which b's did not replace
        await _push(receiver, senders["a"], groups["a"], adapters["a", 3], 2, "a", new_group=False)

        assert (engine.version, engine.adapter_version("a"), engine.adapter_version("b")) == (0, 2, 5)
        assert (senders["a"].committed_version, senders["b"].committed_version) == (2, 5)
        for (policy, seed), version in ((("a", 3), 2), (("b", 2), 5)):
            await reference.update_weights(adapters[policy, seed], version, adapter=policy)
            assert await _outputs(engine, policy) == await _outputs(reference, policy)
            assert (await _outputs(engine, policy))[1] == {version}
    finally:
        receiver.close()
        for sender in senders.values():
            sender.close()
        await engine.close()
        await reference.close()


@pytest.mark.unit
async def test_an_adapter_order_over_a_transport_that_cannot_load_one_is_refused_by_name() -> None:
    receiver = EngineWeightReceiver(object(), actor_id="rollout-0", log=structlog.get_logger())
    order = WeightUpdateOrder(version=3, group={"transport": "sglang", "members": ["learner@a", "rollout-0"]},
                              timeout_s=5.0, adapter="a")
    with pytest.raises(ValueError, match=r"version 3 from learner@a: adapter 'a': the sglang transport cannot load "
                                         "a named adapter"):
        await receiver.apply(order)
    receiver.close()
