"""The compatible server's `/weights_checker` "checksum": SGLang's weight checksum, computed as its CPU path does.

SGLang (`utils/weight_checker.py: _compute_checksum`, `managers/mm_utils.py: tensor_hash`,
`managers/tokenizer_control_mixin.py: check_weights`):

* every parameter, then every buffer, of the model (`named_parameters()`, `named_buffers()`; a name seen twice
  keeps its last tensor), less the non-persistent buffers SGLang recomputes (names containing one of its patterns,
  which differ by release), those marked `_skip_weight_check`, and, in 0.5.23, names containing an entry of
  the request's `skip_tensor_list`: the sha256 of its raw bytes, the first 8 bytes read big-endian, as 16 hex
  digits;
* per rank, `per_gpu_checksum`: the sha256 over the names in sorted order, each name followed by its checksum;
* per engine, `per_engine_checksum`: the sha256 over the ranks' `per_gpu_checksum` (this server is one rank).

On a GPU SGLang hashes each tensor with a Triton kernel instead; the structure is the same. A block-FP8 layer's
weight (an FP8 checkpoint's projection, `Fp8LinearMethod`) is hashed dequantised to bfloat16 under the weight's name
and its `weight_scale_inv` is not hashed on its own (`_build_quantized_set`, `Fp8BlockComparable.dequantize`), in
both releases; so here too, and the dequantised copy this server computes with (`served`) is not SGLang's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from engines.inference.fp8_linear import Fp8Linear
from engines.sglang import protocol
from engines.weights import fp8

# `_NON_PERSISTENT_BUFFER_PATTERNS` of each release's weight_checker.py.
NON_PERSISTENT: dict[str, tuple[str, ...]] = {
    "0.5.15.post1": ("cos_sin_cache", "inv_freq", "freqs_cis", "_weight_fp32"),
    "0.5.23": ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu"),
}


def tensor_checksum(tensor: Tensor) -> str:
    """SGLang's `_hash_tensor` on a CPU: sha256 of the raw bytes, first 8 bytes big-endian, 16 hex digits."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(memoryview(flat.numpy())).digest()
    return f"{int.from_bytes(digest[:8], byteorder='big', signed=False):016x}"


def gpu_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's `per_gpu_checksum` (`overall_checksum`): sha256 over the sorted names, each name then its checksum."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def checked_tensors(model: nn.Module, api: str, skip: Iterable[str] = ()) -> dict[str, Tensor]:
    """The tensors SGLang checksums, by name: parameters then buffers, less those it skips."""
    patterns = NON_PERSISTENT[api] + tuple(skip)
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    fp8_layers = {f"{name}.": module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}
    own = {prefix + part for prefix in fp8_layers for part in ("weight", fp8.scale_name("weight"), "served")}
    checked = {name: tensor for name, tensor in state.items() if name not in own and not any(
        pattern in name for pattern in patterns) and not getattr(tensor, "_skip_weight_check", False)}
    checked.update({prefix + "weight": fp8.dequantise(layer.weight, layer.weight_scale_inv, torch.bfloat16,
                                                      layer.block)
                    for prefix, layer in fp8_layers.items()})  # compared whatever the skip list says, as SGLang's
    return checked


def checksum_answer(model: nn.Module, api: str, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The whole `/weights_checker` body for action "checksum", as SGLang answers it for one rank."""
    checksums = {name: tensor_checksum(tensor) for name, tensor in checked_tensors(model, api, skip).items()}
    placement = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0,
                 "size": 1}
    if api != "0.5.15.post1":
        placement = {"role": "target", **placement}  # 0.5.23 says which runner (target or a draft) a rank is
    rank = {"checksums": checksums, "per_gpu_checksum": gpu_checksum(checksums), "parallelism_info": placement}
    return {"success": True, "message": "Success.", "ranks": [rank],
            "per_engine_checksum": protocol.engine_checksum([rank["per_gpu_checksum"]])}
