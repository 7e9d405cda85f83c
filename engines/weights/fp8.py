"""FP8 rollout weights: the block-scaled float8_e4m3fn format SGLang and Hugging Face FP8 checkpoints use.

An engine that serves FP8 holds each linear projection of the decoder as `<module>.weight` in float8_e4m3fn and
`<module>.weight_scale_inv` in float32, one scale per BLOCK x BLOCK tile of the weight, with `weight ~= q * scale`
over each tile (SGLang's `block_quant_dequant`; DeepSeek-V3's layout, `"weight_block_size": [128, 128]`). The
learner trains in bfloat16 or float32 and quantises what it pushes, so an FP8 push carries one byte per projection
weight instead of two or four, and the engines decode with the weights SGLang would decode with.

Only the projections are quantised (attention q/k/v/o, the MLP's gate/up/down): embeddings, the output head, norms
and biases stay in the push dtype, as SGLang keeps them. A tile at a ragged edge (SmolLM2's 576 columns are 4.5
tiles) is scaled by its own maximum; SGLang itself needs every shard divisible by the block, which SmolLM2's shapes
are not, so such a model runs FP8 on the torch engine only.

The scale of a tile is `1 / (448 / amax)`, the reciprocal of the factor the tile is multiplied by: the formula of
transformers' `Fp8Quantize`, so our quantiser and theirs give the same bytes for the same weight (tested). A tile of
zeros gets scale 1. Activations are quantised as SGLang's W8A8 block kernels do (`fake_quantise_activations`): per
token, per group of BLOCK input features, scale `amax / 448`, computed and dequantised again on the fly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from engines.weights.manifest import TensorSpec
from engines.weights.stream import SpecifiedTensors

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # `<module>.weight` -> `<module>.weight_scale_inv`
ACTIVATION_EPS = 1e-10  # SGLang's floor on an activation group's amax
# A decoder layer's projection weight, as transformers and SGLang name it in llama/qwen2/qwen3-style checkpoints.
_PROJECTION = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantised(name: str, shape: Sequence[int]) -> bool:
    """Whether the tensor `name` travels and is served in FP8: a decoder layer's projection matrix."""
    return len(shape) == 2 and _PROJECTION.search(name) is not None


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: int = BLOCK) -> tuple[int, int]:
    rows, columns = shape
    return math.ceil(rows / block), math.ceil(columns / block)


def quantization_config(block: int = BLOCK) -> dict[str, object]:
    """The `quantization_config` of an FP8 checkpoint in this layout (config.json), as SGLang and transformers read
    it."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def _tiles(matrix: Tensor, block: int) -> tuple[Tensor, int, int]:
    """`matrix` in float32, zero-padded to whole tiles and viewed as (tile rows, block, tile columns, block)."""
    rows, columns = matrix.shape
    tile_rows, tile_columns = scale_shape(matrix.shape, block)
    padded = matrix.to(torch.float32)
    if rows % block or columns % block:
        padded = torch.zeros(tile_rows * block, tile_columns * block, dtype=torch.float32, device=matrix.device)
        padded[:rows, :columns] = matrix
    return padded.view(tile_rows, block, tile_columns, block), rows, columns


def quantise(weight: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """`weight` (2-D, any float dtype) as (float8_e4m3fn values of its shape, float32 scales per tile)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantisation takes a matrix, got shape {tuple(weight.shape)}")
    tiles, rows, columns = _tiles(weight.detach(), block)
    amax = tiles.abs().amax(dim=(1, 3))
    factor = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    values = (tiles * factor[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    values = values.view(tiles.shape[0] * block, tiles.shape[2] * block)[:rows, :columns].contiguous()
    return values, (1.0 / factor).to(torch.float32)


def dequantise(values: Tensor, scales: Tensor, dtype: torch.dtype, block: int = BLOCK) -> Tensor:
    """The weight FP8 `values` and their tile `scales` stand for, in `dtype`: float32 products rounded once, the
    arithmetic of SGLang's `block_quant_dequant` (tested bit for bit against its source)."""
    rows, columns = values.shape
    expanded = scales.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:rows, :columns]
    return (values.to(torch.float32) * expanded).to(dtype)


def quantise_activations(inputs: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """`inputs` (..., features) as SGLang's W8A8 block kernels quantise them: float8_e4m3fn values [tokens, features]
    and float32 scales [tokens, groups], one per token and group of `block` features, `amax / 448`."""
    features = inputs.shape[-1]
    values, scales = _quantised_groups(inputs, block)
    values = values.view(values.shape[0], -1)
    return values[:, :features] if features % block else values, scales.view(scales.shape[0], -1)


def fake_quantise_activations(inputs: Tensor, block: int = BLOCK) -> Tensor:
    """`inputs` rounded through FP8 per token and group (`quantise_activations`), in their own dtype: what SGLang's
    W8A8 block kernels multiply the FP8 weights with. Contiguous, so the matmul after it takes its fast path."""
    features = inputs.shape[-1]
    values, scales = _quantised_groups(inputs, block)
    rounded = values.to(torch.float32).mul_(scales).view(values.shape[0], -1)
    if features % block:
        rounded = rounded[:, :features].contiguous()
    return rounded.view(inputs.shape).to(inputs.dtype)


def _quantised_groups(inputs: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """FP8 values [tokens, groups, block] (the last group zero-padded) and their float32 scales [tokens, groups, 1].
    (No clamp: a group's largest value divided by its scale is 448 up to a float32 rounding, which the cast rounds
    to 448.)"""
    features = inputs.shape[-1]
    groups = math.ceil(features / block)
    flat = inputs.reshape(-1, features).to(torch.float32)
    if features % block:
        flat = torch.nn.functional.pad(flat, (0, groups * block - features))
    grouped = flat.view(flat.shape[0], groups, block)
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp_(min=ACTIVATION_EPS).div_(FP8_MAX)
    return grouped.div(scale).to(FP8), scale


def wire_specs(specs: Iterable[TensorSpec], rest_dtype: torch.dtype | None,
               block: int = BLOCK) -> tuple[TensorSpec, ...]:
    """A push's specs once quantised: each projection as its FP8 values and its scales (in that order), the other
    floating tensors cast to `rest_dtype` when one is given."""
    wire: list[TensorSpec] = []
    for spec in specs:
        if quantised(spec.name, spec.shape):
            wire.append(TensorSpec(spec.name, FP8, spec.shape))
            wire.append(TensorSpec(scale_name(spec.name), torch.float32, scale_shape(spec.shape, block)))
        elif rest_dtype is not None and spec.dtype.is_floating_point:
            wire.append(TensorSpec(spec.name, rest_dtype, spec.shape))
        else:
            wire.append(spec)
    return tuple(wire)


def quantised_stream(named: Iterable[tuple[str, Tensor]], rest_dtype: torch.dtype | None,
                     block: int = BLOCK) -> Iterator[tuple[str, Tensor]]:
    """`named` as it travels (`wire_specs`), each projection quantised when it is pulled."""
    for name, tensor in named:
        if quantised(name, tensor.shape):
            values, scales = quantise(tensor, block)
            yield name, values
            yield scale_name(name), scales
        elif rest_dtype is not None and tensor.dtype.is_floating_point and tensor.dtype != rest_dtype:
            yield name, tensor.to(rest_dtype)
        else:
            yield name, tensor


def quantised_push(tensors: SpecifiedTensors, rest_dtype: torch.dtype | None, block: int = BLOCK) -> SpecifiedTensors:
    """A learner's push in FP8: its specs and its stream as they travel, checked against each other as any push's
    are; closing it closes `tensors` (whose source may hold a lock or a collective iteration)."""
    return SpecifiedTensors(wire_specs(tensors.specs, rest_dtype, block), _Closing(tensors, rest_dtype, block))


class _Closing:
    """`quantised_stream` over `tensors` that closes them when closed, even before it was iterated (a generator
    never started runs no `finally`)."""

    def __init__(self, tensors: SpecifiedTensors, rest_dtype: torch.dtype | None, block: int) -> None:
        self._tensors, self._rest_dtype, self._block = tensors, rest_dtype, block

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return quantised_stream(self._tensors, self._rest_dtype, self._block)

    def close(self) -> None:
        self._tensors.close()
