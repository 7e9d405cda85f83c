"""The torch trainers' optimizer: AdamW, or slime's stateless Adam (`--use-stateless-adam`).

Stateless Adam is AdamW whose moments start from zero at every step, so it keeps no state between steps: no moment
tensors (two float32 copies of every trained parameter saved), nothing to offload or checkpoint. At a fresh AdamW's
first step the bias-corrected moments are exactly the gradient and its square, so the update collapses to
``p <- p * (1 - lr * wd) - lr * g / (|g| + eps)``: element-wise sign descent with a soft threshold at ``eps``. That
is what `--reset-optimizer-states` gives with one optimizer step per rollout batch, without the memory; with several
steps per batch it resets before every step, not only the batch's first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn


class StatelessAdamW(torch.optim.Optimizer):
    """AdamW with the moments reset before every step (see the module docstring); decoupled weight decay."""

    def __init__(self, params: Iterable[Any], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"StatelessAdamW: lr={lr}, eps={eps} and weight_decay={weight_decay} must be >= 0")
        # betas cancel out of a first step (bias correction divides them away); kept so that schedules and
        # checkpoints see AdamW's hyper-parameters
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("StatelessAdamW: sparse gradients are not supported")
                grad = param.grad
                if decay:
                    param.mul_(1 - lr * decay)
                param.addcdiv_(grad, grad.abs().add_(eps), value=-lr)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """An AdamW checkpoint's moments are dropped: this optimizer has none to resume."""
        super().load_state_dict({**state_dict, "state": {}})


def build_adam(params: Iterable[Any], *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
               stateless: bool, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW (`fused`: one kernel per step, on a GPU), or `StatelessAdamW` with `stateless`."""
    if stateless:
        return StatelessAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=fused or None)


def param_groups(model: nn.Module, weight_decay: float, prefix: str = "") -> tuple[list[str], list[dict[str, Any]]]:
    """Decay matrices only: decaying biases and norm gains pulls them toward 0, which no one wants.

    Returns the parameter names (after `prefix`) in the optimizer's own flattened order (decay group first), which
    is how checkpoints key the optimizer state.
    """
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append((prefix + name, parameter))
    groups = [
        {"params": [p for _, p in decay], "weight_decay": weight_decay},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]
    return [name for name, _ in decay + no_decay], groups
