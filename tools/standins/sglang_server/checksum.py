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

On a GPU SGLang hashes each tensor with a Triton kernel instead; the structure is the same. Quantized weights are
hashed dequantized there; this server has none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from engines.sglang import protocol

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
    return {name: tensor for name, tensor in state.items()
            if not any(pattern in name for pattern in patterns) and not getattr(tensor, "_skip_weight_check", False)}


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
