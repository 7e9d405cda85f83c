"""A colocated SGLang server's weight push from a learner on a GPU: CUDA IPC handles through the real HTTP route.

SGLang itself does not fit on the lent GPU machines, so the server is the compatible one, in its own process; it
opens the learner's CUDA staging buffer by handle (the GPU found by its UUID), as SGLang's
`/update_weights_from_tensor` does, and must then serve exactly what the learner pushed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.sglang.client import SglangEngine
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.sglang.tensor_weights import SglangTensorLoader, SglangTensorSender
from tests.engines.test_sglang_weights import ENGINE, perturbed_weights, push

PROMPT = [7, 21, 33, 4, 18]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture
def server(tiny_model_path: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(ServerSpec(model_path=str(tiny_model_path), module="tools.standins.sglang_server",
                                       extra={"torch-threads": "1", "enable-memory-saver": "true"}),
                            startup_timeout=180, log_dir=tmp_path)
    process.start()
    yield process
    process.stop()


@pytest.mark.gpu
async def test_a_push_from_cuda_tensors_reaches_the_server_by_handle(server: ServerProcess,
                                                                       tiny_model_path: Path) -> None:
    client = SglangEngine(server.url, release_tags=("kv_cache", "cuda_graph"))
    sender = SglangTensorSender(host="127.0.0.1", bucket_bytes=64 * 1024, timeout_s=60)
    loader = SglangTensorLoader(client, ENGINE)
    named = perturbed_weights(tiny_model_path, seed=1)
    on_gpu = [(name, tensor.cuda()) for name, tensor in named]
    reference = TorchEngine.from_pretrained(tiny_model_path)
    try:
        await client.on_idle()
        await push(sender, loader, on_gpu, 1, fresh=True)
        assert sender.committed_version == 1
        assert sender._staging is None  # the CUDA staging buffer went back to the device after the push
        await reference.update_weights(named, 1)
        expected = (await reference.generate(GenerateRequest("ref", PROMPT, GREEDY)))[0]
        served = (await client.generate(GenerateRequest("served", PROMPT, GREEDY)))[0]
        assert served.output_ids == expected.output_ids and served.versions == [1] * len(served.output_ids)
    finally:
        sender.close()
        await reference.close()
        await client.close()
