"""slime's `--ref-update-interval` inside a trainer: the reference model becomes a copy of the policy as it is now.

The copy goes parameter by parameter under the same names, into the reference's own tensors (no new allocation,
so a trainer's memory stays what it was at start-up). It needs the reference to be the policy's architecture,
which it is unless `--ref-checkpoint` names another model; then the copy is refused naming what differs.
"""

from __future__ import annotations

import torch
from torch import nn


def copy_policy_into(policy: nn.Module, reference: nn.Module) -> None:
    """reference := policy, parameter by parameter (both frozen or not as they were)."""
    source = dict(policy.named_parameters())
    target = dict(reference.named_parameters())
    if source.keys() != target.keys():
        missing, extra = sorted(source.keys() - target.keys()), sorted(target.keys() - source.keys())
        raise ValueError(f"--ref-update-interval: the reference model is not the policy's architecture, so it cannot "
                         f"become a copy of it (policy-only parameters {missing[:3]}, reference-only {extra[:3]})")
    for name, tensor in target.items():
        if tensor.shape != source[name].shape:
            raise ValueError(f"--ref-update-interval: the reference's {name} is {tuple(tensor.shape)}, the "
                             f"policy's {tuple(source[name].shape)}; the reference must be the policy's architecture")
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(source[name])
