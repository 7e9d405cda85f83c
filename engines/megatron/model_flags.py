"""Megatron's model and training flags, as slime's run scripts pass them: checked, mapped, or refused.

A slime script describes the model twice: once as Megatron flags (`MODEL_ARGS`: `--num-layers 36
--num-query-groups 8 --rotary-base 1000000 ...`) and once as the Hugging Face checkpoint it loads. We build the
model from the checkpoint (mbridge reads its config.json), so the flags add nothing, but a flag that disagrees
with the checkpoint means the user believes they train a different model than the one they load: that is an
error naming both sides (`check_against_hf`), on every backend. Training and performance flags (recompute,
dropout, fusions, attention backend) become TransformerConfig settings (`transformer_overrides`); what our
Megatron path cannot do (context or expert parallelism, MoE and other architectures mbridge/our bridge do not
build, fp16, CPU-offloaded optimizers) is refused at start-up with the flag and the reason
(`refuse_unsupported`). Flags arrive as a plain dict keyed by Megatron's flag name with dashes turned into
underscores (`--num-layers` is `num_layers`); only flags the user set are present.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

# slime's hooks into its Megatron backend: the Megatron trainer runs them (`bridge`, `hooks`), the torch one cannot.
MEGATRON_HOOKS = ("custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                  "custom_megatron_before_train_step_hook_path")
# Families whose HF layout we know well enough to state what a flag must be when the config has no field for it.
_GATED_SILU_ROPE_FAMILIES = ("llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mistral", "mixtral")
_QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_next", "olmo2")


class MegatronFlags(BaseModel):
    """What the Megatron trainer receives from the run's `megatron` section: the flags the user set, and the
    init hook with the flat settings its hooks are called with (slime calls them with its whole `args`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    flags: dict[str, Any] = Field(default_factory=dict)
    init_hook_path: str | None = None
    hook_args: dict[str, Any] = Field(default_factory=dict)
    _namespace: argparse.Namespace | None = PrivateAttr(default=None)

    @property
    def before_log_prob_hook_path(self) -> str | None:
        return self.flags.get("custom_megatron_before_log_prob_hook_path")

    @property
    def before_train_step_hook_path(self) -> str | None:
        return self.flags.get("custom_megatron_before_train_step_hook_path")

    def namespace(self) -> argparse.Namespace:
        """`hook_args` as slime's `args`: built once, then the same object for every hook call that is given it,
        since slime's hooks share one namespace and may keep state on it (a copy: `hook_args` stays plain JSON)."""
        if self._namespace is None:
            self._namespace = argparse.Namespace(**self.hook_args)
        return self._namespace


# -- checks against the Hugging Face config ---------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padding: up to a multiple of --make-vocab-size-divisible-by x TP."""
    multiple = divisible_by * tensor_parallel
    return math.ceil(vocab_size / multiple) * multiple


def check_against_hf(flags: Mapping[str, Any], hf_config: Any, *, tensor_parallel: int = 1) -> None:
    """Raise one ValueError listing every model-shape flag that contradicts the checkpoint's config.json."""
    problems = []
    for flag, (hf_field, expected, agrees) in _hf_expectations(hf_config).items():
        given = flags.get(flag)
        if given is None or expected is None or agrees(given, expected):
            continue
        problems.append(f"--{_dashed(flag)} {given} but the HF checkpoint has {hf_field}={expected}")
    vocab = flags.get("vocab_size")
    if vocab is not None:
        divisible_by = int(flags.get("make_vocab_size_divisible_by") or 128)
        ours = padded_vocab_size(int(vocab), divisible_by, tensor_parallel)
        theirs = padded_vocab_size(int(hf_config.vocab_size), divisible_by, tensor_parallel)
        if ours != theirs:
            problems.append(f"--vocab-size {vocab} (padded to {ours} by --make-vocab-size-divisible-by "
                            f"{divisible_by} x TP {tensor_parallel}) but the HF checkpoint has "
                            f"vocab_size={hf_config.vocab_size} (padded: {theirs})")
    padded = flags.get("padded_vocab_size")
    if padded is not None and int(padded) < int(hf_config.vocab_size):
        problems.append(f"--padded-vocab-size {padded} but the HF checkpoint has vocab_size={hf_config.vocab_size} "
                        "(the padded vocabulary must hold it)")
    if problems:
        raise ValueError("Megatron model flags disagree with the HF checkpoint: " + "; ".join(problems))


def _equal(given: Any, expected: Any) -> bool:
    if isinstance(given, float) or isinstance(expected, float):
        return math.isclose(float(given), float(expected), rel_tol=1e-6)
    return bool(given == expected)


def _hf_expectations(hf: Any) -> dict[str, tuple[str, Any, Callable[[Any, Any], bool]]]:
    """flag -> (HF field as the error names it, its value or None when unknown, does a given value agree)."""
    family = getattr(hf, "model_type", "")
    known = family in _GATED_SILU_ROPE_FAMILIES
    heads = getattr(hf, "num_attention_heads", None)
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    hidden = getattr(hf, "hidden_size", None)
    head_dim = getattr(hf, "head_dim", None) or (hidden // heads if hidden and heads else None)
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    rope_type = rope.get("rope_type", rope.get("type", "default" if theta is not None else None))
    eps_field = "rms_norm_eps" if hasattr(hf, "rms_norm_eps") else "layer_norm_eps"
    norm_type = ("RMSNorm" if eps_field == "rms_norm_eps" else "LayerNorm") if hasattr(hf, eps_field) else None
    qk_norm = getattr(hf, "use_qk_norm", None)
    if qk_norm is None and (known or family in _QK_NORM_FAMILIES):
        qk_norm = family in _QK_NORM_FAMILIES
    qkv_bias = getattr(hf, "attention_bias", None)
    if family in ("qwen2", "qwen2_moe"):
        qkv_bias = True  # Qwen2 always biases q, k and v (its config has no switch)
    linear_bias = bool(getattr(hf, "mlp_bias", False)) or (family in ("llama", "mistral") and bool(qkv_bias))
    experts = _first_attr(hf, "num_experts", "n_routed_experts", "num_local_experts")
    shared = getattr(hf, "shared_expert_intermediate_size", None)
    if shared is None and getattr(hf, "n_shared_experts", None) and getattr(hf, "moe_intermediate_size", None):
        shared = hf.n_shared_experts * hf.moe_intermediate_size
    mla = getattr(hf, "kv_lora_rank", None) is not None
    same = _equal
    return {
        "num_layers": ("num_hidden_layers", getattr(hf, "num_hidden_layers", None), same),
        "hidden_size": ("hidden_size", hidden, same),
        "ffn_hidden_size": ("intermediate_size", getattr(hf, "intermediate_size", None), same),
        "num_attention_heads": ("num_attention_heads", heads, same),
        "num_query_groups": ("num_key_value_heads", kv_heads, same),
        # Without --group-query-attention Megatron ignores --num-query-groups and builds full multi-head attention.
        "group_query_attention": ("num_key_value_heads", kv_heads, lambda given, kv: given or kv == heads),
        # Under multi-latent attention HF's head_dim is the RoPE part only; Megatron's --kv-channels means no HF field.
        "kv_channels": ("head_dim", None if mla else head_dim, same),
        "swiglu": ("hidden_act", getattr(hf, "hidden_act", None),
                   lambda given, act: bool(given) == (act in ("silu", "swish"))),
        "normalization": (f"{eps_field} (norm type)", norm_type, same),
        "norm_epsilon": (eps_field, getattr(hf, eps_field, None), same),
        "apply_layernorm_1p": ("model_type", family if known else None, lambda given, _: not given),
        "qk_layernorm": (f"model_type {family!r} (q/k norms)", qk_norm, lambda given, norm: bool(given) == norm),
        "rotary_base": ("rope_theta", theta, same),
        "rotary_percent": ("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0 if known else None),
                           same),
        "rotary_interleaved": ("model_type", family if known else None, lambda given, _: not given),
        "position_embedding_type": ("rope_theta", theta, lambda given, _: given == "rope"),
        "use_rope_scaling": ("rope_type", rope_type, lambda given, kind: bool(given) == (kind == "llama3")),
        "max_position_embeddings": ("max_position_embeddings", getattr(hf, "max_position_embeddings", None), same),
        "untie_embeddings_and_output_weights": (
            "tie_word_embeddings", bool(getattr(hf, "tie_word_embeddings", False)),
            lambda given, tied: bool(given) != tied),
        "disable_bias_linear": ("mlp_bias/attention_bias", linear_bias, lambda given, bias: bool(given) != bias),
        "add_qkv_bias": ("attention_bias", qkv_bias, lambda given, bias: bool(given) == bool(bias)),
        "num_experts": ("num_experts", experts if experts is not None else "absent (a dense model)", same),
        "moe_router_topk": ("num_experts_per_tok", getattr(hf, "num_experts_per_tok", None), same),
        "moe_ffn_hidden_size": ("moe_intermediate_size", getattr(hf, "moe_intermediate_size", None), same),
        "moe_shared_expert_intermediate_size": ("shared expert size", shared, same),
        "multi_latent_attention": ("kv_lora_rank", getattr(hf, "kv_lora_rank", None) if mla else "absent",
                                   lambda given, _: bool(given) == mla),
        "q_lora_rank": ("q_lora_rank", getattr(hf, "q_lora_rank", None), same),
        "kv_lora_rank": ("kv_lora_rank", getattr(hf, "kv_lora_rank", None), same),
        "qk_head_dim": ("qk_nope_head_dim", getattr(hf, "qk_nope_head_dim", None), same),
        "qk_pos_emb_head_dim": ("qk_rope_head_dim", getattr(hf, "qk_rope_head_dim", None), same),
        "v_head_dim": ("v_head_dim", getattr(hf, "v_head_dim", None) if mla else None, same),
    }


def _first_attr(obj: Any, *names: str) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _dashed(flag: str) -> str:
    return flag.replace("_", "-")


# -- refusals ----------------------------------------------------------------------------------------------------

# MoE settings whose computation neither backend's bridge builds (the torch backend takes routing from the HF model).
_MOE_REFUSALS = {
    "moe_router_enable_expert_bias": "the aux-loss-free expert bias (DeepSeek-V3's router) is not built",
    "moe_enable_deepep": "DeepEP's dispatcher is CUDA-only; use --moe-token-dispatcher-type alltoall",
    "moe_shared_expert_intermediate_size": "shared experts (Qwen2-MoE, DeepSeek) are not built by the Megatron "
                                           "backend's bridge (qwen3_moe, mixtral)",
}
_ARCHITECTURE_FLAGS = ("multi_latent_attention", "attention_output_gate", "use_gated_attention",
                       "post_mlp_layernorm", "post_self_attn_layernorm")


def refuse_unsupported(flags: Mapping[str, Any], *, megatron_core: bool) -> None:
    """Raise one ValueError naming every flag the trainer cannot honour, each with its reason. `megatron_core`: the
    trainer builds its model with megatron-core (it runs slime's hooks, expert parallelism and Megatron's dropout);
    otherwise it trains the Hugging Face model (the torch backend)."""
    problems = []

    def refuse(flag: str, reason: str) -> None:
        problems.append(f"--{_dashed(flag)} {flags[flag]}: {reason}")

    if flags.get("fp16"):
        refuse("fp16", "fp16 training (loss scaling) is not implemented; use --bf16")
    for name in ("fp8_format", "fp8_recipe"):
        if flags.get(name):
            refuse(name, "FP8 training is not implemented; the trainers train in bf16 (an engine may still serve "
                   "FP8 weights)")
    if flags.get("optimizer", "adam") != "adam":
        refuse("optimizer", "only adam (AdamW) is supported")
    if megatron_core and (flags.get("context_parallel_size") or 1) > 1:
        refuse("context_parallel_size", "megatron-core 0.16 splits attention across a context-parallel group only "
               "in Transformer Engine's attention (its local DotProductAttention asserts context_parallel_size 1), "
               "and the Megatron backend builds the local one; --train-backend torch splits rows across learner "
               "ranks (docs/long-context.md)")
    if not megatron_core:
        for name in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
            if (flags.get(name) or 1) > 1:
                refuse(name, "the torch backend keeps every expert on every rank; use --train-backend megatron")
    if flags.get("accumulate_allreduce_grads_in_fp32") is False:
        refuse("accumulate_allreduce_grads_in_fp32", "gradients are always accumulated and reduced in float32")
    if flags.get("mtp_num_layers") and megatron_core:
        refuse("mtp_num_layers", "the Megatron backend builds no multi-token-prediction layers: megatron-core 0.16's "
               "GPTModel computes their loss only when given labels, and then returns losses instead of the logits "
               "this learner reads, with the MTP gradient reaching the policy (slime patches megatron-core to "
               "detach it); --train-backend torch trains them (docs/slime.md)")
    elif flags.get("mtp_num_layers") and not flags.get("enable_mtp_training"):
        refuse("mtp_num_layers", "the torch backend builds MTP layers only to train them: add --enable-mtp-training, "
               "or drop --mtp-num-layers (exports then leave the checkpoint's MTP weights out)")
    for name in ("attention_dropout", "hidden_dropout"):
        if not megatron_core and flags.get(name):
            refuse(name, "the torch backend takes dropout from the HF config; use --train-backend megatron")
    if not megatron_core:
        balancing = flags.get("moe_router_load_balancing_type") or "aux_loss"
        if flags.get("moe_aux_loss_coeff") and balancing not in ("aux_loss", "none"):
            refuse("moe_router_load_balancing_type", "the torch backend computes megatron's micro-batch aux_loss "
                   "only (or none)")
        for name in (*MEGATRON_HOOKS, "custom_model_provider_path"):
            if flags.get(name):
                refuse(name, "a Megatron hook needs --train-backend megatron (only the Megatron backend runs it)")
        if problems:
            raise ValueError("; ".join(problems))
        return
    if flags.get("custom_model_provider_path"):
        refuse("custom_model_provider_path", "the Megatron backend builds the model from the HF checkpoint (mbridge)")
    balancing = flags.get("moe_router_load_balancing_type") or "aux_loss"
    if balancing not in ("aux_loss", "none"):
        refuse("moe_router_load_balancing_type", "the Megatron backend computes megatron's micro-batch aux_loss only "
               "(or none), as the torch backend does")
    for name, reason in _MOE_REFUSALS.items():
        if flags.get(name):
            refuse(name, reason)
    for name in _ARCHITECTURE_FLAGS:
        if flags.get(name):
            refuse(name, "this architecture is not built by the Megatron backend's bridge (dense llama, qwen2, qwen3)")
    if flags.get("spec"):
        refuse("spec", "the Megatron backend picks the layer spec itself (transformer-engine's or the local one)")
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if flags.get(name) is not None:
            refuse(name, "uneven pipeline stages are not supported yet")
    for name in ("optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer"):
        if flags.get(name):
            refuse(name, "the Megatron trainer runs (and checkpoints) only megatron's on-GPU Adam")
    problems.extend(_recompute_problems(flags))
    if problems:
        raise ValueError("; ".join(problems))


def _recompute_problems(flags: Mapping[str, Any]) -> list[str]:
    """Megatron's rules for the three recompute flags, stated with the flags' names."""
    granularity, method = flags.get("recompute_granularity"), flags.get("recompute_method")
    layers = flags.get("recompute_num_layers")
    if granularity == "full" and (method is None or layers is None):
        return ["--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers"]
    if granularity != "full" and (method is not None or layers is not None):
        return [f"--recompute-method/--recompute-num-layers need --recompute-granularity full (got {granularity})"]
    return []


# -- mapping onto megatron ---------------------------------------------------------------------------------------


def transformer_overrides(flags: Mapping[str, Any], *, layer_spec: str) -> dict[str, Any]:
    """TransformerConfig settings the flags ask for, on top of `bridge.config_overrides` (flags win).

    --sequence-parallel asks for what the bridge already does where it can (TE spec, TP > 1); only
    --no-sequence-parallel changes it. --attention-backend selects transformer-engine's kernel; the local spec's
    attention is torch SDPA, which picks its own kernel, so there the flag has nothing to select.
    """
    overrides: dict[str, Any] = {}
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers", "attention_dropout",
                 "hidden_dropout", "attention_softmax_in_fp32"):
        if flags.get(name) is not None:
            overrides[name] = flags[name]
    if flags.get("sequence_parallel") is False:
        overrides["sequence_parallel"] = False
    if flags.get("deterministic_mode"):
        overrides["deterministic_mode"] = True
    switches_off = {"no_masked_softmax_fusion": "masked_softmax_fusion", "no_rope_fusion": "apply_rope_fusion",
                    "no_gradient_accumulation_fusion": "gradient_accumulation_fusion"}
    for flag, field in switches_off.items():
        if flags.get(flag):
            overrides[field] = False
    backend = flags.get("attention_backend")
    if backend is not None and backend != "auto" and layer_spec == "transformer_engine":
        overrides["attention_backend"] = backend
    return overrides


def run_init_hook(path: str, hook_args: Mapping[str, Any] | argparse.Namespace) -> None:
    """slime's --custom-megatron-init-path: `hook(args)` once megatron's parallel state exists, before the model
    is built; `args` is a namespace of the run's flat settings (slime passes its whole argument namespace): the
    given one (`MegatronFlags.namespace()`, the one the step hooks get), or one built from a mapping."""
    from policies.plugins import load_callable

    hook = load_callable(path, what="--custom-megatron-init-path")
    hook(hook_args if isinstance(hook_args, argparse.Namespace) else argparse.Namespace(**hook_args))
