"""FP8 matmuls that read the FP8 bytes: an `Fp8Linear`'s output from its float8_e4m3fn weight, the weight's tile
scales and the inputs quantised per token and group (`fp8.quantise_activations`), with no dequantised copy of the
weight kept anywhere.

A weight scaled per 128 x 128 tile times inputs scaled per row and group of 128 features is a sum over the blocks of
input features of row-wise scaled products: for block k, `x_k @ W_k^T` scaled by the inputs' scale of each row
(`[M, 1]`) and the weight's scale of each output's tile (`[1, N]`). So torch's scaled matmul computes it in one of
two recipes, whichever the device runs (`recipes`, probed once per device against the dequantised product):

- `blockwise`: one call of `torch.nn.functional.scaled_mm` with `BlockWise1x128` inputs and `BlockWise128x128`
  weights, cuBLAS's DeepSeek-style scaling (CUDA 12.9+, sm90). It needs whole tiles: K and N multiples of 128
  (SGLang's own rule for FP8 block checkpoints). The pinned CPU torch (2.13) refuses these recipes.
- `rowwise`: `torch._scaled_mm` once per block of input features, with row-wise scales, the products accumulated
  in float32. Runs on a CPU (torch 2.13) and on CUDA where cuBLAS has row-wise scaling with a float32 output
  (sm90). A ragged last block (SmolLM2's 576 = 4.5 x 128) is a narrower product; its tile's scale covers it. On
  CUDA every operand's dimension must be a multiple of 16 (cuBLAS's FP8 rule; the CPU has none): a layer whose
  shape breaks it computes with a dequantised copy instead (`Fp8Linear.use`).

Which kernel an engine uses (`resolve`): `auto` takes the scaled matmul on CUDA and the dequantised copy on a CPU,
where the scaled matmul is measured several times slower (docs/fp8.md: torch's CPU kernel converts the FP8 weight
to float32 on every call, at about 1 ns an element), so there it is a memory-for-speed choice, made by name.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
from torch import Tensor

from engines.weights import fp8

logger = logging.getLogger(__name__)

Kernel = Literal["auto", "scaled_mm", "dequantised"]
KERNELS: tuple[str, ...] = ("auto", "scaled_mm", "dequantised")
Recipe = Literal["blockwise", "rowwise"]
CUDA_MULTIPLE = 16  # cuBLAS's FP8 operands: every dimension a multiple of 16


def resolve(kernel: str, device: torch.device | str) -> str:
    """`kernel` ('auto', 'scaled_mm' or 'dequantised') as what layers on `device` compute with: 'scaled_mm' or
    'dequantised'. Refuses a name it does not know, and 'scaled_mm' on a device where no recipe runs."""
    if kernel not in KERNELS:
        raise ValueError(f"FP8 kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    device = torch.device(device)
    if kernel == "auto":
        return "scaled_mm" if device.type == "cuda" and recipes(device) else "dequantised"
    if kernel == "scaled_mm" and not recipes(device):
        raise ValueError(f"FP8 kernel 'scaled_mm': torch {torch.__version__} runs no FP8 scaled matmul on {device} "
                         "(neither block-wise nor row-wise scaling; the log says why); use 'dequantised'")
    return kernel


def recipe_for(device: torch.device | str, out_features: int, in_features: int, block: int) -> Recipe | None:
    """The recipe a layer of this shape computes with on `device`, None when none fits it."""
    device = torch.device(device)
    for recipe in recipes(device):
        if fits(recipe, device, out_features, in_features, block):
            return recipe
    return None


def fits(recipe: Recipe, device: torch.device, out_features: int, in_features: int, block: int) -> bool:
    """Whether a layer's shape meets `recipe`'s rules on `device` (the module's docstring says which and why)."""
    if recipe == "blockwise":
        return block == fp8.BLOCK and in_features % block == 0 and out_features % block == 0
    if device.type != "cuda":
        return True
    last = in_features % block or block
    return all(size % CUDA_MULTIPLE == 0 for size in (block, last, out_features))


def recipes(device: torch.device | str) -> tuple[Recipe, ...]:
    """The recipes that run on `device` and give the dequantised product, best first (probed once per device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _probed(str(device))


@functools.cache
def _probed(device: str) -> tuple[Recipe, ...]:
    found: list[Recipe] = []
    for recipe, (rows, out_features, in_features) in (("blockwise", (17, 256, 256)), ("rowwise", (3, 144, 320))):
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=generator).to(device)
        inputs = torch.randn(rows, in_features, generator=generator).to(device)
        values, scales = fp8.quantise(weight)
        expected = fp8.fake_quantise_activations(inputs) @ fp8.dequantise(values, scales, torch.float32).T
        try:
            got = scaled_linear(*fp8.quantise_activations(inputs), values, scales, fp8.BLOCK, recipe)
        except (RuntimeError, NotImplementedError, ValueError, ImportError) as error:  # ImportError: an older torch
            logger.info("FP8 %s scaled matmul does not run on %s: %s", recipe, device, str(error).splitlines()[0])
            continue
        error = (got.float() - expected).abs().max().item()
        if error <= 1e-2 * expected.abs().max().item():  # bfloat16's rounding, far below a wrong scale's error
            found.append(recipe)
        else:
            logger.warning("FP8 %s scaled matmul on %s is off by %.3g against the dequantised product; not used",
                           recipe, device, error)
    return tuple(found)


def scaled_linear(inputs: Tensor, input_scales: Tensor, weight: Tensor, weight_scale_inv: Tensor, block: int,
                  recipe: Recipe) -> Tensor:
    """`inputs @ weight^T` of the FP8 operands, in float32 ([M, N]): `inputs` [M, K] float8_e4m3fn with
    `input_scales` [M, ceil(K / block)], `weight` [N, K] float8_e4m3fn with `weight_scale_inv` per tile."""
    if recipe == "blockwise":
        return _blockwise(inputs, input_scales, weight, weight_scale_inv)
    return _rowwise(inputs, input_scales, weight, weight_scale_inv, block)


def _rowwise(inputs: Tensor, input_scales: Tensor, weight: Tensor, weight_scale_inv: Tensor, block: int) -> Tensor:
    out_features, in_features = weight.shape
    # each output's tile scale, per block of input features: [K blocks, N]
    column_scales = weight_scale_inv.repeat_interleave(block, dim=0)[:out_features].T.contiguous()
    out: Tensor | None = None
    for index, start in enumerate(range(0, in_features, block)):
        columns = slice(start, min(start + block, in_features))
        product = torch._scaled_mm(inputs[:, columns].contiguous(), weight[:, columns].T,
                                   scale_a=input_scales[:, index:index + 1].contiguous(),
                                   scale_b=column_scales[index:index + 1], out_dtype=torch.float32)
        out = product if out is None else out.add_(product)
    assert out is not None, "a layer has at least one input feature"
    return out


def _blockwise(inputs: Tensor, input_scales: Tensor, weight: Tensor, weight_scale_inv: Tensor) -> Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    # cuBLAS's layouts: the inputs' scales outer-dimension-major; the weight's [N tiles, K tiles] padded to a multiple
    # of 4 K tiles and passed transposed ([K tiles padded, N tiles], K-major in memory).
    tiles = weight_scale_inv.shape[1]
    padded = torch.nn.functional.pad(weight_scale_inv, (0, -tiles % 4)) if tiles % 4 else weight_scale_inv
    return scaled_mm(inputs, weight.T, input_scales.T.contiguous().T, ScalingType.BlockWise1x128,
                     padded.contiguous().T, ScalingType.BlockWise128x128, output_dtype=torch.float32)
