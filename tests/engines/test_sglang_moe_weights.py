"""A mixture-of-experts model's weights into an SGLang(-compatible) server: experts arrive under checkpoint names.

transformers holds a layer's experts stacked (`mlp.experts.gate_up_proj`); SGLang's MoE models load experts under
the checkpoint's per-expert names only and pass over any other name while the update still succeeds. The
compatible server does the same, so these tests see what a real server would serve: its per-tensor checksums
(`/weights_checker`) and its generations, against a torch engine given the same weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from actors.config import RunConfig
from actors.learner.publish import sent_layout
from engines.inference.base import GenerateRequest
from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol
from engines.sglang.client import SglangEngine
from engines.sglang.launch import ServerProcess
from engines.sglang.weights import SglangWeightLoader, SglangWeightSender
from engines.training import TorchTrainer, TorchTrainerConfig
from engines.weights.base import TransferReport, WeightsDiffer
from engines.weights.layouts import CheckpointLayout, is_stacked_expert
from tests.engines.test_sglang_weights import ENGINE, GREEDY, PROMPT, compat_server, perturbed_weights, push
from tools.standins.sglang_server.checksum import tensor_checksum
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model


@pytest.fixture(scope="module")
def moe_path(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))


@pytest.fixture(scope="module")
def moe_server(moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from compat_server(moe_path, tmp_path_factory.mktemp("sglang-moe-logs"))


async def served_checksums(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}{protocol.WEIGHTS_CHECKER.path}", json={"action": protocol.CHECKSUM_ACTION}) as response:
        answer: dict[str, Any] = await response.json()
    assert answer["success"], answer
    return answer["ranks"][0]["checksums"]


def both_ends(url: str) -> tuple[SglangEngine, SglangWeightSender, SglangWeightLoader]:
    """The server's client, the learner's sender and the rollout worker's loader, as a push to `url` needs them."""
    client = SglangEngine(url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", bucket_bytes=64 * 1024, timeout_s=20)
    return client, sender, SglangWeightLoader(client, ENGINE)


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_experts_reach_the_server_under_checkpoint_names_and_are_skipped_stacked(
        moe_server: ServerProcess, moe_path: Path) -> None:
    client, sender, loader = both_ends(moe_server.url)
    named = perturbed_weights(moe_path, seed=1)  # as a trainer yields them: experts stacked
    stacked = [name for name, _ in named if is_stacked_expert(name)]
    assert len(stacked) == 2 * 2  # gate_up_proj and down_proj of TinyModelSpec's two layers
    reference = TorchEngine.from_pretrained(moe_path)
    try:
        before = await served_checksums(moe_server.url)
        # What the learner sent before: acknowledged, the engine's checksum moved, and no expert changed.
        await push(sender, loader, named, version=1, fresh=True)
        assert sender.committed_version == 1 and await client.server_weight_version() == 1
        after_stacked = await served_checksums(moe_server.url)
        assert {name: after_stacked[name] for name in stacked} == {name: before[name] for name in stacked}
        query = "model.layers.0.self_attn.q_proj.weight"
        assert after_stacked[query] != before[query]  # the dense weights moved: the checksum "change" check passes

        layout = CheckpointLayout(AutoConfig.from_pretrained(moe_path))
        sent = list(layout(named))
        assert not any(is_stacked_expert(name) for name, _ in sent)
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in dict(sent)
        await push(sender, loader, sent, version=2, fresh=False)
        served = await served_checksums(moe_server.url)
        assert {name: served[name] for name, _ in named} == {name: tensor_checksum(t) for name, t in named}

        await reference.update_weights(named, 2)
        expected = (await reference.generate(GenerateRequest("expected", PROMPT, GREEDY)))[0]
        got = (await client.generate(GenerateRequest("served", PROMPT, GREEDY)))[0]
        assert got.output_ids == expected.output_ids
        assert got.log_probs == pytest.approx(expected.log_probs, abs=1e-5)
    finally:
        sender.close()
        await reference.close()
        await client.close()


@pytest.mark.unit
def test_the_learner_sends_checkpoint_names_to_sglang_and_the_torch_trainer_splits_only_stacked_experts(
        moe_path: Path, tiny_model_path: Path) -> None:
    """The torch engine loads transformers' names itself; an SGLang server needs the checkpoint's, and a dense
    model's names are its checkpoint's already."""
    assert sent_layout(RunConfig(rollout_engine="sglang")) == "checkpoint"
    assert sent_layout(RunConfig(rollout_engine="sglang", colocate=True)) == "checkpoint"  # update_weights_from_tensor
    assert sent_layout(RunConfig()) == sent_layout(RunConfig(rollout_engine="sglang", lora_rank=4)) == "model"

    moe = TorchTrainer(TorchTrainerConfig(model_path=moe_path))
    stacked, split = list(moe.named_tensors()), list(moe.named_tensors("checkpoint"))
    assert [name for name, _ in stacked] == [name for name, _ in moe._model.named_parameters()]
    assert not any(is_stacked_expert(name) for name, _ in split)
    assert len(split) == len(stacked) - 4 + 2 * 3 * 4  # each layer's two stacks -> 3 projections x 4 experts
    assert dict(split).keys() == load_file(str(moe_path / "model.safetensors")).keys()

    dense = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path))
    assert [name for name, _ in dense.named_tensors("checkpoint")] == [name for name, _ in dense.named_tensors()]


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_a_checked_push_whose_experts_the_server_passed_over_is_not_committed_and_names_them(
        moe_server: ServerProcess, moe_path: Path) -> None:
    """The weight check catches the skip by itself: every pushed tensor changed, the server's experts did not."""
    client, sender, loader = both_ends(moe_server.url)
    spec = sender.open_group(["learner", ENGINE])
    layout = CheckpointLayout(AutoConfig.from_pretrained(moe_path))

    async def checked_push(named: list, version: int) -> TransferReport:
        receiving = asyncio.create_task(loader.apply(spec.to_dict(), version, 20.0))
        try:
            if version == 1:
                await asyncio.to_thread(sender.wait_for_receivers)
            # In bfloat16, as GPU runs push (--bf16): a server holds the bits sent, so a tensor left as it was is news.
            return await asyncio.to_thread(sender.send, named, version, dtype=torch.bfloat16, fingerprint=True)
        finally:
            await asyncio.gather(receiving, return_exceptions=True)

    try:
        first = await checked_push(perturbed_weights(moe_path, seed=11), 1)  # stacked: nothing to compare with yet
        assert first.fingerprints is not None and first.fingerprints.ok
        with pytest.raises(WeightsDiffer) as failed:
            await checked_push(perturbed_weights(moe_path, seed=12), 2)
        [why] = failed.value.check.why.values()
        assert why.startswith("4 tensor(s) its server serves did not change since version 1") and (
            "e.g. model.layers.0.mlp.experts.down_proj" in why), why
        assert sender.committed_version == 1
        for version, seed in ((3, 13), (4, 14)):  # checkpoint names: every served tensor moves with the push
            report = await checked_push(list(layout(perturbed_weights(moe_path, seed=seed))), version)
            assert report.fingerprints is not None and report.fingerprints.matched == (ENGINE,), report.fingerprints
        assert sender.committed_version == 4
    finally:
        sender.close()
        await client.close()
