"""Log-probs and entropy over a vocabulary split across tensor-parallel ranks.

Same distribution as `engines.training.logprobs` (softmax(logits / temperature), float32 reductions), so
importance ratios against the inference engine stay unbiased; only the reductions over the vocabulary become
all-reduces over the TP group. Each rank holds logits for columns [start, start + width); the max is a
detached all-reduce (a constant shift, gradient-free), the partition function, the target logit and the
entropy's expectation are all-reduced with megatron's `reduce_from_tensor_model_parallel_region` (forward
all-reduce, backward identity): every TP rank computes the same replicated loss from these sums, so each rank's
local logits receive exactly d loss / d logits. Columns past the real vocabulary (padding added to make the
vocabulary divisible by TP) are masked out of the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from engines.training.base import ModelOutputs

_MASKED_LOGIT = -1e30  # exp() underflows to 0 and 0 * this stays finite (unlike -inf) in the entropy


def vocab_parallel_log_probs(
    logits: Tensor, targets: Tensor, *, temperature: float, with_entropy: bool, vocab_size: int
) -> ModelOutputs:
    """`logits` [N, V / TP] (this rank's vocabulary slice) at the positions that predict `targets` [N]."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    group = parallel_state.get_tensor_model_parallel_group()  # named: megatron will stop assuming it
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    if start + width > vocab_size:
        padded = torch.arange(start, start + width, device=logits.device) >= vocab_size
        scaled = scaled.masked_fill(padded, _MASKED_LOGIT)
    row_max = scaled.detach().max(dim=-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1), group=group)
    log_partition = sum_exp.log()
    local = targets - start
    owned = (local >= 0) & (local < width)
    target_logit = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * owned
    log_probs = reduce_from_tensor_model_parallel_region(target_logit, group=group) - log_partition
    entropy = None
    if with_entropy:
        probs = exp / sum_exp.unsqueeze(-1)
        expected_logit = reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1), group=group)
        entropy = log_partition - expected_logit
    return ModelOutputs(log_probs=log_probs, entropy=entropy)
