"""The SGLang client and the learner-side sender against a REAL `sglang.launch_server` (GPU and sglang needed).

The same checks as against the compatible server: greedy parity with the torch engine, pause/continue, and a
weight update broadcast by our sender (NCCL) that the server receives and serves.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.sglang.client import SglangEngine
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.sglang.weights import SglangWeightLoader, SglangWeightSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]
PROMPT = [7, 21, 33, 4, 18]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
# Checked against both supported releases' server arguments by test_sglang_contract.py. `--disable-cuda-graph`
# is deprecated there in favour of the per-phase switches (`--cuda-graph-backend-{decode,prefill}=disabled`).
GPU_SERVER_ARGS: dict[str, str] = {
    "dtype": "float32",
    "mem-fraction-static": "0.3",
    "disable-decode-cuda-graph": "true",
    "disable-prefill-cuda-graph": "true",
    "attention-backend": "torch_native",
    "skip-server-warmup": "true",
}
# NCCL refuses two ranks on one device: where a test's sender broadcasts (on cuda:0), the server takes the last GPU.
SERVER_GPU = max(torch.cuda.device_count() - 1, 0)
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="an NCCL weight group needs the sender and the server on two GPUs")


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    spec = ServerSpec(
        model_path=str(tiny_model_path),
        module="sglang.launch_server",
        random_seed=1,
        base_gpu_id=SERVER_GPU,
        extra=GPU_SERVER_ARGS,
    )
    process = ServerProcess(spec, startup_timeout=600, log_dir=tmp_path_factory.mktemp("sglang-logs"))
    process.start()
    yield process
    process.stop()


async def test_real_server_greedy_output_equals_the_torch_engine(server: ServerProcess, tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, device="cuda") as reference:
        expected = (await reference.generate(GenerateRequest("g", PROMPT, GREEDY)))[0]
    async with SglangEngine(server.url) as client:
        got = (await client.generate(GenerateRequest("g", PROMPT, GREEDY)))[0]
    assert got.output_ids == expected.output_ids
    assert got.log_probs == pytest.approx(expected.log_probs, abs=1e-3)  # different kernels than the torch engine


async def test_real_server_pause_keep_holds_requests_until_continue(server: ServerProcess) -> None:
    async with SglangEngine(server.url) as client:
        await client.pause("keep")
        task = asyncio.create_task(client.generate(GenerateRequest("held", PROMPT, GREEDY)))
        await asyncio.sleep(1.0)
        assert not task.done()
        await client.resume()
        assert (await asyncio.wait_for(task, 60))[0].output_ids


@needs_two_gpus
async def test_real_server_receives_weights_from_our_sender(server: ServerProcess, tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.1)
    named = list(model.state_dict().items())
    sender = SglangWeightSender(host="127.0.0.1", backend="nccl", timeout_s=120)
    async with SglangEngine(server.url) as client, TorchEngine(model, None) as reference:
        spec = sender.open_group(["learner", "rollout-0-0"])
        receiving = asyncio.create_task(SglangWeightLoader(client, "rollout-0-0").apply(spec.to_dict(), 1, 120))
        await asyncio.to_thread(sender.wait_for_receivers)
        await asyncio.to_thread(sender.send, named, 1)
        await receiving
        assert sender.committed_version == 1 and await client.server_weight_version() == 1
        got = (await client.generate(GenerateRequest("w", PROMPT, GREEDY)))[0]
        expected = (await reference.generate(GenerateRequest("w", PROMPT, GREEDY)))[0]
        assert got.output_ids == expected.output_ids and got.versions == [1] * len(got.output_ids)
    sender.close()


@needs_two_gpus
async def test_real_server_serves_an_adapter_pushed_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    """A LoRA run's push into real SGLang: the `sglang_lora` transport, `/load_lora_adapter`, `lora_path`."""
    import structlog

    from actors.config import RunConfig
    from actors.rollout.engine_factory import lora_server_args
    from engines.sglang.adapter_endpoints import AdapterServing
    from engines.training.lora import LoraSettings, adapter_tensors, wrap
    from engines.weights.transport import SGLANG_LORA, SenderOptions, resolve_transport

    rank, alpha, targets = 4, 8.0, ["q_proj", "v_proj"]
    run = RunConfig(rollout_engine="sglang", lora_rank=rank, lora_alpha=alpha, target_modules=targets)
    extra = {**GPU_SERVER_ARGS, **lora_server_args(run), "lora-backend": "torch_native"}
    spec = ServerSpec(model_path=str(tiny_model_path), module="sglang.launch_server", random_seed=1,
                      base_gpu_id=SERVER_GPU, extra=extra)
    server = ServerProcess(spec, startup_timeout=600, log_dir=tmp_path)
    server.start()
    trained = wrap(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                   LoraSettings(rank=rank, alpha=alpha, target_modules=tuple(targets)))
    generator = torch.Generator().manual_seed(0)
    named = [(name, torch.randn(t.shape, generator=generator) * 0.3) for name, t in adapter_tensors(trained)]
    transport = resolve_transport(SGLANG_LORA)
    sender = transport.make_sender(SenderOptions(host="127.0.0.1", backend="nccl", timeout_s=120.0))
    try:
        async with SglangEngine(server.url, adapters=AdapterServing(alpha, str(tmp_path))) as client, \
                TorchEngine.from_pretrained(tiny_model_path, device="cuda", lora_scaling=alpha / rank) as reference:
            loader = transport.make_loader(client, "rollout-0-0", structlog.get_logger())
            group = sender.open_group(["learner", "rollout-0-0"]).to_dict()
            receiving = asyncio.create_task(loader.apply(group, 1, 120))
            await asyncio.to_thread(sender.wait_for_receivers)
            await asyncio.to_thread(sender.send, named, 1)
            await receiving
            await reference.update_weights(named, 1)
            got = (await client.generate(GenerateRequest("a", PROMPT, GREEDY)))[0]
            expected = (await reference.generate(GenerateRequest("a", PROMPT, GREEDY)))[0]
            assert sender.committed_version == 1 and client.adapter is not None
            assert got.output_ids == expected.output_ids and got.versions == [1] * len(got.output_ids)
            loader.close()
    finally:
        sender.close()
        server.stop()


async def test_real_colocated_server_hands_its_memory_over_and_loads_weights_by_reference(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """`--colocate` on SGLang: the server on the learner's GPU releases its memory (weights backed up to the CPU),
    takes the weights back, and loads a push of CUDA IPC handles through `/update_weights_from_tensor`."""
    from engines.sglang import protocol
    from engines.sglang.tensor_weights import SglangTensorLoader, SglangTensorSender

    extra = {**GPU_SERVER_ARGS, "enable-memory-saver": "true", "enable-weights-cpu-backup": "true"}
    spec = ServerSpec(model_path=str(tiny_model_path), module="sglang.launch_server", random_seed=1, base_gpu_id=0,
                      extra=extra)
    server = ServerProcess(spec, startup_timeout=600, log_dir=tmp_path)
    server.start()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.1)
    sender = SglangTensorSender(host="127.0.0.1", timeout_s=120)
    try:
        async with SglangEngine(server.url, release_tags=protocol.MEMORY_TAGS) as client, \
                TorchEngine(model, None) as reference:
            await client.on_idle()
            assert client.released_memory == protocol.MEMORY_TAGS
            spec_dict = sender.open_group(["learner", "rollout-0-0"]).to_dict()
            receiving = asyncio.create_task(SglangTensorLoader(client, "rollout-0-0").apply(spec_dict, 1, 120))
            await asyncio.to_thread(sender.send, list(model.state_dict().items()), 1)
            await receiving
            assert sender.committed_version == 1 and await client.server_weight_version() == 1
            got = (await client.generate(GenerateRequest("c", PROMPT, GREEDY)))[0]
            expected = (await reference.generate(GenerateRequest("c", PROMPT, GREEDY)))[0]
            assert client.released_memory == ()
            assert got.output_ids == expected.output_ids and got.versions == [1] * len(got.output_ids)
    finally:
        sender.close()
        server.stop()
