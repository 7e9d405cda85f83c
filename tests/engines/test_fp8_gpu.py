"""The FP8 scaled matmul on CUDA (`fp8_matmul`): which recipes the GPU runs, each equal to the dequantised product
on SmolLM2's ragged shapes and on whole tiles, and an engine that serves FP8 there keeping no dense copy. Written
without a GPU; `tools/gpu/session.sh OUT install gpu-tests` runs it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engines.inference import fp8_matmul
from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.fp8_linear import Fp8Linear
from engines.inference.torch_engine import TorchEngine
from engines.weights import fp8
from tests.engines.test_fp8 import SMOLLM2_SHAPES, _matrix

WHOLE_TILES = ((1536, 512), (256, 896))  # block-wise scaling needs them


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*SMOLLM2_SHAPES, *WHOLE_TILES])
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_each_recipe_the_gpu_runs_equals_the_dequantised_product(shape: tuple[int, int], rows: int) -> None:
    device = torch.device("cuda")
    found = fp8_matmul.recipes(device)
    print(f"recipes on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda}): {found}")
    assert found, "an H100/H200 runs at least row-wise scaling"
    out_features, in_features = shape
    values, scales = fp8.quantise(_matrix(out_features, in_features).to(device))
    inputs = torch.randn(rows, in_features, device=device)
    expected = fp8.fake_quantise_activations(inputs) @ fp8.dequantise(values, scales, torch.float32).T
    for recipe in found:
        if not fp8_matmul.fits(recipe, device, out_features, in_features, fp8.BLOCK):
            continue
        got = fp8_matmul.scaled_linear(*fp8.quantise_activations(inputs), values, scales, fp8.BLOCK, recipe)
        assert (got - expected).abs().max() <= 1e-3 * expected.abs().max(), recipe


@pytest.mark.gpu
async def test_a_cuda_engine_serves_fp8_by_the_scaled_matmul_and_decodes_as_the_dequantised_one(
        tiny_model_path: Path) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for kernel in ("dequantised", True):  # True: the device's choice, the scaled matmul on CUDA
        async with TorchEngine.from_pretrained(tiny_model_path, device="cuda", fp8=kernel) as engine:
            layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
            assert layers and all((layer.served is None) == (kernel is True) for layer in layers)
            ids = engine.tokenizer.encode("12+34=")
            outputs[kernel] = (await asyncio.wait_for(engine.generate(GenerateRequest("r", ids, params)), 120))[0]
    assert outputs[True].output_ids == outputs["dequantised"].output_ids
    assert outputs[True].log_probs == pytest.approx(outputs["dequantised"].log_probs, abs=1e-3)
