"""Batch-invariant inference: a sequence's logits do not depend on what its engine decodes beside it.

A continuous batch changes shape every step: rows join and leave, and left padding widens the KV cache to the
longest row. With stock kernels a row's logits then move in the last bits with the batch around it, because
the reductions (the attention softmax and its weighted sum over the cache, a norm's mean, a matmul's inner
products) are grouped differently for other shapes. Those bits reach training: the sampled tokens' log-probs
are mu in the loss (TIS's weight, PPO's ratio against the engine), and over enough steps a flipped sample.
Two seeded runs then drift apart by rounding (docs/experiments.md measured it). SGLang's answer is
`--enable-deterministic-inference`; this is the torch engine's, without patching the model:

* **Attention** is a function registered with transformers' `AttentionInterface`: scores, softmax and the
  weighted sum of values are elementwise products reduced by `pairwise_sum`, a fixed tree whose result does not
  depend on how much padding surrounds a row's keys.
* **Every other kernel with a reduction or a vector tail** (linear layers, norms, activations) sees its input's
  rows padded to a multiple of `ROW_MULTIPLE`: forward hooks on the leaf modules pad before and cut after. With
  at least that many rows, MKL's GEMM groups each row's inner products the same whatever the row count, and no
  element falls into a kernel's scalar tail loop (which computes `rsqrt` and `sigmoid` to other bits than the
  vector body does).
* **Prefill** runs each distinct sequence on its own (`TorchEngine(deterministic=True)` does this), so no
  prompt's keys ever sit next to another prompt's padding.

`tests/engines/test_batch_invariant.py` checks the result on this machine's kernels: a sequence decoded alone and
decoded inside batches of other sequences gets the same logits, bit for bit. That is a property of the kernels
torch calls, so it is a test, not an assumption: other hardware or another torch may need another multiple.
It holds for one thread count; a run repeats only with the same `--torch-threads`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engines.inference.fp8_linear import Fp8Linear
from engines.inference.sampling import RowParams, sample_next_tokens

ATTENTION_NAME = "slipstream_batch_invariant"
ROW_MULTIPLE = 32  # two AVX-512 float vectors: the widest stride ATen's elementwise loops take before their tail


def pairwise_sum(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by halving: pad to a power of two with leading zeros, then add the two halves until one is left.

    Leading zeros only ever meet zeros or pass a value through unchanged (`0 + x == x` exactly), so a row's
    result is the same tree over the smallest power of two that holds its non-zero tail, however wide the
    padded tensor is. That is what makes attention over a left-padded cache independent of the padding.
    """
    dim = dim % values.dim()
    length = values.shape[dim]
    width = 1 << max(length - 1, 0).bit_length()
    if width != length:
        pad_shape = list(values.shape)
        pad_shape[dim] = width - length
        values = torch.cat([values.new_zeros(pad_shape), values], dim=dim)
    while width > 1:
        width //= 2
        values = values.narrow(dim, 0, width) + values.narrow(dim, width, width)
    return values.squeeze(dim)


def batch_invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention from elementwise products and `pairwise_sum` (the AttentionInterface contract).

    query [batch, heads, q, head_dim]; key and value [batch, kv_heads, keys, head_dim]; attention_mask a boolean
    [batch, 1, q, keys] (True: attend) or None for plain causal attention. Returns [batch, q, heads, head_dim].
    The products are materialized, so memory grows with keys x head_dim per query: meant for the CPU engine's small
    models and for reproducible runs, not for throughput.
    """
    if dropout:
        raise ValueError(f"batch-invariant attention: dropout {dropout}; inference runs without dropout")
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = pairwise_sum(query.unsqueeze(-2) * key.unsqueeze(-3), dim=-1) * scale  # [b, h, q, keys]
    allowed = _allowed(attention_mask, query.shape[-2], key.shape[-2], query.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)  # a fully masked row: 0s
    weights = (scores - peak).exp()
    weights = weights / pairwise_sum(weights, dim=-1).unsqueeze(-1).clamp(min=torch.finfo(scores.dtype).tiny)
    output = pairwise_sum(weights.unsqueeze(-1) * value.unsqueeze(-3), dim=-2)  # [b, h, q, head_dim]
    return output.transpose(1, 2).contiguous(), None


def _allowed(mask: torch.Tensor | None, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    if mask is None:  # causal, the queries being the last `queries` positions
        positions = torch.arange(keys, device=device)
        return (positions.unsqueeze(0) <= positions[keys - queries :].unsqueeze(1)).view(1, 1, queries, keys)
    if mask.dtype != torch.bool:  # an additive float mask: 0 where attended
        return mask == 0
    return mask


def _boolean_mask_function() -> Callable[..., Any]:
    """transformers' SDPA mask builder, made to always return the explicit boolean mask we read in `_allowed`."""
    from transformers.masking_utils import sdpa_mask

    def build(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    return build


def register_attention() -> str:
    """Make `ATTENTION_NAME` a valid `attn_implementation`; idempotent. Returns the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as missing:  # both exist from transformers 4.53 on
        raise RuntimeError(f"deterministic inference needs transformers' AttentionInterface and "
                           f"AttentionMaskInterface (transformers >= 4.53): {missing}") from missing
    AttentionInterface.register(ATTENTION_NAME, batch_invariant_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _boolean_mask_function())
    return ATTENTION_NAME


class RowPadding:
    """Forward hooks that pad a leaf module's input rows to a multiple of `ROW_MULTIPLE` and cut its output back.

    The leading dimensions are flattened into rows first (these modules act on the last dimension only), so a
    prefill's tokens and a decode step's sequences are padded alike.
    """

    def __init__(self) -> None:
        self._leading: dict[int, tuple[torch.Size, int]] = {}

    def attach(self, module: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        return [module.register_forward_pre_hook(self._pad), module.register_forward_hook(self._cut)]

    def _pad(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return None
        inputs = args[0]
        leading, rows = inputs.shape[:-1], inputs[..., 0].numel()
        padded_rows = padded_row_count(rows)
        flat = inputs.reshape(rows, inputs.shape[-1])
        if padded_rows != rows:
            flat = torch.cat([flat, flat.new_zeros(padded_rows - rows, flat.shape[-1])])
        self._leading[id(module)] = (leading, rows)
        return (flat, *args[1:])

    def _cut(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        saved = self._leading.pop(id(module), None)
        if saved is None or not isinstance(output, torch.Tensor):
            return None
        leading, rows = saved
        return output[:rows].reshape(*leading, output.shape[-1])


def _is_padded_leaf(module: nn.Module) -> bool:
    """Linear layers, norms and activations: the leaves that reduce over, or run kernels on, a row's last dimension."""
    if any(True for _ in module.children()):
        return False
    if isinstance(module, (nn.Linear, Fp8Linear)):
        return True
    name = type(module).__name__
    if name.endswith(("RMSNorm", "LayerNorm")):
        return True
    module_path = type(module).__module__
    return module_path == "torch.nn.modules.activation" or module_path.startswith("transformers.activations")


def padded_row_count(rows: int) -> int:
    return -(-max(rows, 1) // ROW_MULTIPLE) * ROW_MULTIPLE


def sample_padded_rows(
    logits: torch.Tensor, params: RowParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next_tokens` on rows padded to a multiple of `ROW_MULTIPLE` (copies of the first row), cut back.

    Softmax and the top-k/top-p renormalization reduce over the vocabulary; a lone row takes another path through
    those kernels than a row among many (measured: top-k's `logsumexp` over a 152k vocabulary).
    """
    rows = logits.shape[0]
    extra = padded_row_count(rows) - rows
    if extra == 0:
        return sample_next_tokens(logits, params, uniforms)

    def pad(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, values[:1].expand(extra, *values.shape[1:])])

    padded = RowParams(pad(params.temperature), pad(params.top_p), pad(params.top_k), params.any_sampled,
                       params.any_greedy, params.any_truncated)
    tokens, log_probs = sample_next_tokens(pad(logits), padded, None if uniforms is None else pad(uniforms))
    return tokens[:rows], log_probs[:rows]


def make_batch_invariant(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Switch `model` to batch-invariant attention and pad its leaves' rows; returns the hooks (to remove them)."""
    name = register_attention()
    set_implementation = getattr(model, "set_attn_implementation", None)
    if set_implementation is None:
        raise RuntimeError(f"{type(model).__name__}: no set_attn_implementation; deterministic inference needs a "
                           "transformers model that dispatches attention through AttentionInterface")
    set_implementation(name)
    if getattr(model.config, "_attn_implementation", None) != name:
        raise RuntimeError(f"{type(model).__name__} kept attention {model.config._attn_implementation!r}: it does "
                           "not dispatch through AttentionInterface, so its logits cannot be made batch-invariant")
    padding = RowPadding()
    handles: list[torch.utils.hooks.RemovableHandle] = []
    for module in model.modules():
        if _is_padded_leaf(module):
            handles.extend(padding.attach(module))
    return handles
