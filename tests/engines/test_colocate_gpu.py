"""Colocated turns on one GPU: the learner's optimizer state leaves the device between steps and the engine's
cached blocks go back to it when generation runs out of work."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.training import TorchTrainer, TorchTrainerConfig
from tests.support.training import half_response_samples, loss_fn


@pytest.mark.gpu
def test_an_offloading_trainer_steps_like_one_that_keeps_its_state_on_the_gpu(tiny_model_path: Path) -> None:
    def trainer(offload: bool) -> TorchTrainer:
        return TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-3, device="cuda",
                                               offload_optimizer=offload))

    kept, offloaded = trainer(False), trainer(True)
    for _ in range(2):
        for each in (kept, offloaded):
            each.train_step(half_response_samples(), loss_fn(half_response_samples()), temperature=1.0)
        moments = [value for state in offloaded._optimizer.state.values() for value in state.values()
                   if isinstance(value, torch.Tensor) and value.dim() > 0]
        assert moments and all(value.device.type == "cpu" for value in moments)
    expected = dict(kept.named_tensors())
    for name, tensor in offloaded.named_tensors():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)


@pytest.mark.gpu
async def test_an_idle_colocated_engine_returns_its_cached_blocks(tiny_model_path: Path) -> None:
    # What the engine can give back is the allocator's cached-but-unused memory. Everything still allocated stays
    # (the weights, and cuBLAS's workspace, which the first matmul allocates and keeps: the first GPU run of this
    # test compared against the weights alone and failed on it). An engine that keeps its memory is the contrast.
    kept = await _cached_bytes_after_generating(tiny_model_path, release=False)
    released = await _cached_bytes_after_generating(tiny_model_path, release=True)
    assert released <= 8 * 2**20 < kept, f"cached but unused after the turn: {released} B released, {kept} B kept"


async def _cached_bytes_after_generating(model_path: Path, release: bool) -> int:
    torch.cuda.empty_cache()
    async with TorchEngine.from_pretrained(model_path, device="cuda", release_memory_when_idle=release) as engine:
        params = SamplingParams(temperature=1.0, max_new_tokens=500, ignore_eos=True, n=64)
        await engine.generate(GenerateRequest("r", [7, 12, 30], params))
        for _ in range(500):
            if not release or (await engine.health())["memory_releases"]:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the engine never reported a memory release after running out of work")
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
