"""Log-probs straight from hidden states: the output head and the softmax fused, a chunk of tokens at a time.

A learner needs, per response token, log p(token) and sometimes the entropy, under softmax(logits / T). Computed
the plain way, the model's head writes float32 logits [tokens x vocabulary], log_softmax writes a second copy,
the entropy a third and a fourth, and autograd keeps them for the backward: with a 150k vocabulary that is ~0.6 MB
per token per copy, 5 GB each at 8k tokens. Here the head's matrix product and the reductions run together over
chunks of rows, so no more than one chunk's logits exist at once; the backward recomputes each chunk's logits
from the saved hidden states (one more head-sized product) instead of keeping them.

How we get the hidden states from an unmodified Hugging Face model: its head (`get_output_embeddings()`, a plain
`nn.Linear`) becomes a `HiddenPassingLinear`, which hands its input back while `hidden_states_only()` is active
in the calling thread. So the model's own forward, through DDP and PEFT wrappers alike, returns the hidden states
at exactly the positions it would have computed logits for, after its final norm. A model that changes its logits
after the head (Gemma's soft-capping, Cohere's logit scale) is found by a probe at install time, which compares
both paths, and keeps the plain path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import replace

import torch
from torch import Tensor, nn

from engines.training.base import ModelOutputs, TrainSample
from engines.training.logprobs import token_log_probs
from engines.training.micro_batches import PackedInputs, forward_packed, pack_inputs

# Elements of one chunk of float32 logits (128 MiB); the backward holds two such buffers at a time.
CHUNK_ELEMENTS = 1 << 25
PROBE_TOLERANCE = 1e-4  # relative to the largest logit: what float32 reassociation can move

_PASS_HIDDEN: ContextVar[bool] = ContextVar("slipstream_pass_hidden", default=False)


class HiddenPassingLinear(nn.Linear):
    """The model's output head, unchanged but for one switch: inside `hidden_states_only()` it returns its input."""

    def forward(self, input: Tensor) -> Tensor:
        if _PASS_HIDDEN.get():
            return input
        return super().forward(input)


@contextlib.contextmanager
def hidden_states_only() -> Iterator[None]:
    """While active in this thread, a fused head returns hidden states where the model would return logits."""
    token = _PASS_HIDDEN.set(True)
    try:
        yield
    finally:
        _PASS_HIDDEN.reset(token)


def fuse_output_head(model: nn.Module) -> bool:
    """Switch `model`'s head to a `HiddenPassingLinear` if its logits are the head's product and nothing more.

    Returns whether it did. The probe runs one short forward both ways; a head PEFT adapted, a head that is not a
    plain linear layer, or logits changed after the head leave the model as it was.
    """
    head = model.get_output_embeddings()
    if isinstance(head, HiddenPassingLinear):
        return True
    if type(head) is not nn.Linear:
        return False
    head.__class__ = HiddenPassingLinear
    if not _same_logits_both_ways(model, head):
        head.__class__ = nn.Linear
        return False
    return True


def fused_head(model: nn.Module) -> HiddenPassingLinear | None:
    head = model.get_output_embeddings()
    return head if isinstance(head, HiddenPassingLinear) else None


def _same_logits_both_ways(model: nn.Module, head: nn.Linear) -> bool:
    """One short packed forward (the trainer's only way of running the model) through the head and around it."""
    vocab = head.weight.shape[0]
    tokens = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(0))
    inputs = pack_inputs([TrainSample(tokens, response_length=4)]).to(head.weight.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = forward_packed(model, inputs).float()
            with hidden_states_only():
                hidden = forward_packed(model, inputs)
            fused = nn.functional.linear(hidden, head.weight, head.bias).float()
    finally:
        model.train(was_training)
    if fused.shape != logits.shape:
        return False
    scale = max(1.0, float(logits.abs().max()))
    return float((fused - logits).abs().max()) <= PROBE_TOLERANCE * scale


def token_outputs(network: nn.Module, inputs: PackedInputs, *, head_of: nn.Module, temperature: float,
                  with_entropy: bool) -> ModelOutputs:
    """Log-probs (and entropy) of one packed micro-batch's response tokens. `network` runs the forward (the DDP
    wrapper, or the policy with its adapter off); `head_of` is the model whose output head it ends in. A fused
    head (`output_head`) never materialises the [tokens x vocabulary] logits; any other takes the plain path."""
    head = fused_head(head_of)
    if head is None:
        outputs = token_log_probs(forward_packed(network, inputs), inputs.targets, temperature=temperature,
                                  with_entropy=with_entropy)
    else:
        with hidden_states_only():
            hidden = forward_packed(network, inputs)
        outputs = head_log_probs(hidden, head, inputs.targets, temperature=temperature, with_entropy=with_entropy)
    row = inputs.context_row  # a context-parallel rank computed its own tokens; its group gets the micro-batch's
    if row is None:
        return outputs
    return replace(outputs, log_probs=row.join_tokens(outputs.log_probs),
                   entropy=None if outputs.entropy is None else row.join_tokens(outputs.entropy))


def head_log_probs(hidden: Tensor, head: nn.Linear, targets: Tensor, *, temperature: float,
                   with_entropy: bool) -> ModelOutputs:
    """log p(targets) and optionally the entropy under softmax(head(hidden) / temperature), chunk by chunk.

    `hidden` [N, H] are the states the head reads at the positions predicting `targets` [N]. Same values as
    `logprobs.token_log_probs(head(hidden), ...)`, differentiable in `hidden` and the head's parameters.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = max(1, CHUNK_ELEMENTS // head.weight.shape[0])
    log_probs, entropy = _FusedHeadLogProbs.apply(hidden, head.weight, head.bias, targets, float(temperature),
                                                  with_entropy, rows)
    return ModelOutputs(log_probs=log_probs, entropy=entropy if with_entropy else None)


class _FusedHeadLogProbs(torch.autograd.Function):
    """Per chunk of rows, z = head(h) / T, p = softmax(z):  log p_t = z_t - logsumexp(z),  H = logsumexp(z) - p.z,
    and the gradient in z of (g_lp log p_t + g_H H) is  (g_lp (onehot_t - p) - g_H p (log p + H)) / T.

    A head that trains (full fine-tuning) needs that gradient's product with the hidden states, so the backward
    recomputes each chunk's z: one more head-sized product, the price of never holding [N x V]. A frozen head (LoRA)
    needs only the hidden states' gradient, W^T of the above, which is linear in g_lp and g_H: the forward keeps
    its two [N x H] parts, W_t - p W and (p (log p + H)) W, and the backward just weighs them, at the plain path's
    cost.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                with_entropy: bool, rows: int) -> tuple[Tensor, Tensor]:
        device, count = hidden.device, hidden.shape[0]
        frozen_head = hidden.requires_grad and not weight.requires_grad and (bias is None or not bias.requires_grad)
        log_probs = torch.empty(count, dtype=torch.float32, device=device)
        log_norms = torch.empty(count, dtype=torch.float32, device=device)
        entropy = torch.empty(count if with_entropy else 0, dtype=torch.float32, device=device)
        from_target = torch.empty(hidden.shape if frozen_head else (0,), dtype=hidden.dtype, device=device)
        from_entropy = torch.empty(hidden.shape if frozen_head and with_entropy else (0,), dtype=hidden.dtype,
                                   device=device)
        for start in range(0, count, rows):
            end = min(count, start + rows)
            chunk_targets = targets[start:end, None]
            scaled = _scaled_logits(hidden[start:end], weight, bias, temperature)
            log_norm = torch.logsumexp(scaled, dim=-1)
            log_norms[start:end] = log_norm
            log_probs[start:end] = scaled.gather(-1, chunk_targets)[:, 0] - log_norm
            if not (with_entropy or frozen_head):
                continue
            log_p = scaled.sub_(log_norm[:, None])
            probs = log_p.exp()
            if with_entropy:
                entropy[start:end] = -(probs * log_p).sum(-1)
            if frozen_head:
                expected_row = probs.to(weight.dtype) @ weight
                from_target[start:end] = (weight[targets[start:end]] - expected_row).to(hidden.dtype)
            if frozen_head and with_entropy:
                weighted = log_p.add_(entropy[start:end, None]).mul_(probs)
                from_entropy[start:end] = (weighted.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(hidden, weight, bias, targets, log_norms, entropy, from_target, from_entropy)
        ctx.temperature, ctx.rows, ctx.frozen_head = temperature, rows, frozen_head
        ctx.autocast = _autocast_state(device)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor, grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, log_norms, entropy, from_target, from_entropy = ctx.saved_tensors
        with_entropy = entropy.numel() > 0
        if ctx.frozen_head:
            grad = from_target * grad_log_probs[:, None].to(hidden.dtype)
            if with_entropy:
                grad -= from_entropy * grad_entropy[:, None].to(hidden.dtype)
            return grad.div_(ctx.temperature), None, None, None, None, None, None
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        with _autocast_like(ctx.autocast):
            for start in range(0, hidden.shape[0], ctx.rows):
                end = min(hidden.shape[0], start + ctx.rows)
                chunk = hidden[start:end]
                log_p = _scaled_logits(chunk, weight, bias, ctx.temperature).sub_(log_norms[start:end, None])
                probs = log_p.exp()
                g_lp = grad_log_probs[start:end, None].float()
                if with_entropy:  # -(g_lp + g_H (log p + H)) p, in log_p's buffer
                    coefficient = log_p.add_(entropy[start:end, None]).mul_(grad_entropy[start:end, None].float())
                    grad_z = coefficient.add_(g_lp).mul_(probs).neg_()
                else:
                    grad_z = probs.mul_(-g_lp)
                grad_z.scatter_add_(-1, targets[start:end, None], g_lp).div_(ctx.temperature)
                if needs_hidden:
                    grad_hidden[start:end] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
                if needs_weight:
                    grad_weight.addmm_(grad_z.t(), chunk.float())
                if needs_bias:
                    grad_bias.add_(grad_z.sum(0))
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """float32 logits / T of one chunk, computed as the model's head computes them (autocast included)."""
    logits = nn.functional.linear(hidden, weight, bias).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def _autocast_state(device: torch.device) -> tuple[str, bool, torch.dtype]:
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def _autocast_like(state: tuple[str, bool, torch.dtype]) -> contextlib.AbstractContextManager[object]:
    """The backward recomputes the logits under the forward's autocast setting, so both see the same values."""
    kind, enabled, dtype = state
    return torch.autocast(device_type=kind, dtype=dtype, enabled=enabled)
