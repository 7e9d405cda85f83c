"""slime's ``args`` namespace, built read-only from our RunConfig, for plugins that read ``args.<flag>``.

Every setting of every section appears under its flag name (ours are slime's names where slime has the flag), plus
the attributes slime's plugins read that have no section here: ``sglang_router_ip``/``sglang_router_port`` point at
this rollout worker's own engine server (a plugin's ``POST http://{ip}:{port}/generate`` reaches the engine that
leased the group), and switches slime's generate path consults (``partial_rollout``, ``ci_test``, ...) take slime's
defaults. ``rollout_num_gpus`` left unset (slime always has a number: with ``--colocate`` the learner's GPUs) is
one engine's GPUs, the engine those two point at, so a client that sizes its connection pool as slime does
(``sglang_server_concurrency * rollout_num_gpus // rollout_num_gpus_per_engine``, strands-sglang's) gets one
engine's worth. The keys of slime's ``--custom-config-path`` YAML (``RunConfig.custom_config``) are attributes too, as
slime merges them into its args. Plugins should treat it as read-only: it is rebuilt per worker, and a write
reaches no other actor.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from actors.config import RunConfig

__all__ = ["build_args", "sampling_params"]

# slime attributes with no counterpart here, at slime's defaults (what its own generate path expects).
_SLIME_DEFAULTS: dict[str, Any] = {
    "partial_rollout": False, "mask_offpolicy_in_partial_rollout": False, "ci_test": False,
    "rollout_stop_token_ids": None, "rollout_skip_special_tokens": False,
    "sglang_server_concurrency": 512, "sglang_dp_size": None,
    "reward_key": None, "eval_reward_key": None, "rollout_sample_hook_path": [], "router_policy": None,
    "loss_type": "policy_loss", "custom_loss_function_path": None,
}


def build_args(config: RunConfig, *, server_url: str | None = None) -> SimpleNamespace:
    """The namespace a slime plugin receives as ``args``; ``server_url`` is this worker's engine server."""
    values: dict[str, Any] = dict(_SLIME_DEFAULTS)
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            values.update(value.model_dump())
        else:
            values[name] = value
    values.update(config.custom_config)  # slime's --custom-config-path: its keys are args attributes
    values.setdefault("rollout_max_prompt_len", None)
    if values.get("rollout_num_gpus") is None:
        values["rollout_num_gpus"] = config.engine.rollout_num_gpus_per_engine
    values["rollout_stop"] = list(config.rollout.rollout_stop) or None
    values["rollout_top_k"] = config.rollout.rollout_top_k or -1  # slime spells "off" -1
    values["sglang_enable_deterministic_inference"] = config.engine.deterministic_inference
    # slime's name for the packed micro-batch budget: retool's generate caps a context at CP size x this
    values["max_tokens_per_gpu"] = values.get("micro_batch_tokens")
    if server_url is not None:
        parts = urlsplit(server_url if "://" in server_url else f"http://{server_url}")
        values["sglang_router_ip"], values["sglang_router_port"] = parts.hostname, parts.port
    else:
        values["sglang_router_ip"], values["sglang_router_port"] = None, None
    return SimpleNamespace(**values)


def sampling_params(config: RunConfig, *, evaluation: bool = False) -> dict[str, Any]:
    """The SGLang sampling-params dict slime hands a generate plugin (the plugin may edit its own copy)."""
    rollout, ev = config.rollout, config.eval
    temperature = ev.eval_temperature if evaluation else rollout.rollout_temperature
    top_p = ev.eval_top_p if evaluation and ev.eval_top_p is not None else rollout.rollout_top_p
    top_k = ev.eval_top_k if evaluation and ev.eval_top_k is not None else rollout.rollout_top_k
    max_new = ev.eval_max_response_len if evaluation and ev.eval_max_response_len else rollout.rollout_max_response_len
    min_new = config.eval.eval_min_new_tokens if evaluation else None
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k or -1,
        "max_new_tokens": max_new,
        "stop": list(rollout.rollout_stop) or None,
        "stop_token_ids": list(rollout.rollout_stop_token_ids) or None,
        "skip_special_tokens": rollout.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        **({"min_new_tokens": min(min_new, max_new)} if min_new else {}),
    }
