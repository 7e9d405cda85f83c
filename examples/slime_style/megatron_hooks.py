"""slime's three Megatron hooks, written as slime users write them: a trace of what the trainer did and when.

Loads unchanged with ``--custom-megatron-init-path examples.slime_style.megatron_hooks.init``,
``--custom-megatron-before-log-prob-hook-path examples.slime_style.megatron_hooks.before_log_prob`` and
``--custom-megatron-before-train-step-hook-path examples.slime_style.megatron_hooks.before_train_step``
(``--train-backend megatron``). Each call appends one JSON line to the file ``MEGATRON_HOOK_TRACE`` names (nothing
when it is unset): which pass or step, and the parameter norm the step starts from, which is what one looks at
first when a run diverges.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def _trace(record: dict[str, Any]) -> None:
    path = os.environ.get("MEGATRON_HOOK_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as trace:
            trace.write(json.dumps(record) + "\n")


def init(args: Any) -> None:
    """Once, before the model is built."""
    _trace({"hook": "init", "seed": args.seed})


def before_log_prob(args: Any, model: list[torch.nn.Module], store_prefix: str) -> None:
    """Before each log-prob pass: "" for the policy's own, "ref_" for the reference model's."""
    _trace({"hook": "log_prob", "store_prefix": store_prefix, "chunks": len(model)})


def before_train_step(args: Any, rollout_id: int, step_id: int, model: list[torch.nn.Module], optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    """Before each optimizer step of a rollout batch."""
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([p.detach().float().norm() for p in model[0].parameters()]))
    _trace({"hook": "train_step", "rollout_id": rollout_id, "step_id": step_id, "param_norm": float(norm)})
