"""Hugging Face <-> megatron-core weights and model construction, on top of mbridge.

Choice of bridge. mbridge 0.15.1 is pure Python over megatron-core and installs without any other dependency
(einops aside), so it works on a CPU-only torch; it knows the Llama, Qwen2 and Qwen3 layouts (fused QKV with
grouped heads, fused gate/up, TP split and merge, pipeline broadcast). megatron-bridge 0.3.1 requires
transformer-engine (CUDA-only, builds against torch at install time) and pins transformers 4.x, so it cannot
install next to our stack. We therefore use mbridge for the name and layout mapping and its load/export
routines, and add only what our configuration differs in:

- the LOCAL layer spec (plain megatron modules, no transformer-engine): its norms are separate modules
  (`input_layernorm`, `pre_mlp_layernorm`) instead of being fused into `linear_qkv`/`linear_fc1`, so two
  name mappings are added;
- tied embeddings: mbridge's Qwen2 bridge rewrites a CLASS-level mapping dict for tied models (leaking into
  later untied instances in the same process), and its Llama bridge does not handle ties at all; we keep the
  mapping per instance;
- rope parameters: transformers 5 moved `rope_theta` into `rope_parameters`, which mbridge does not read;
- the TransformerConfig: no sequence parallelism, no fused kernels, no dropout, per-token loss scaling (see
  `engines.megatron.trainer`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
_LOCAL_SPEC_NORMS = {
    "other": {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]},
    "mlp": {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]},
}


class HFBridge:
    """One HF architecture seen from megatron: its TransformerConfig, its GPTModel stages, and its weights.

    Construct after megatron's parallel state is initialised (mbridge reads TP/PP ranks from it).
    """

    def __init__(self, model_path: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"model path {self.model_path}: no config.json (expected a Hugging Face folder)")
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        family = self.hf_config.model_type
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"{self.model_path}: model_type {family!r} is not supported by the Megatron backend; "
                f"supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        _refuse_unsupported(self.hf_config, self.model_path)
        from megatron.core import parallel_state

        tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
        vocab = self.hf_config.vocab_size
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        self._bridge = _bridge_class(family)(
            self.hf_config,
            dtype=dtype,
            make_vocab_size_divisible_by=tensor_parallel if vocab % tensor_parallel else None,
        )
        self._bridge.set_extra_args(**_config_overrides(dtype))
        self.vocab_size = vocab
        self.padded_vocab_size = math.ceil(vocab / tensor_parallel) * tensor_parallel

    @property
    def transformer_config(self) -> Any:
        return self._bridge.config

    def build_stage(self) -> nn.Module:
        """This rank's pipeline stage of the GPT model, with the local (transformer-engine-free) layer spec."""
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        config = self._bridge.config
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
        # mbridge pads the vocabulary in its load/export only once its provider has recorded the sizes.
        self._bridge.vocab_size, self._bridge.padded_vocab_size = self.vocab_size, self.padded_vocab_size
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=self.padded_vocab_size,
            max_sequence_length=self.hf_config.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type="rope",
            **_rope_arguments(self.hf_config),
        )
        for parameter in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(parameter)
        return model

    def load_hf_weights(self, stages: list[nn.Module], hf_path: str | Path | None = None) -> None:
        """Fill `stages` from an HF folder's safetensors (TP rank 0 reads, then scatters the shards)."""
        with torch.no_grad():
            self._bridge.load_weights(stages, str(Path(hf_path or self.model_path).resolve()))

    def export_hf_weights(self, stages: list[nn.Module]) -> Iterator[tuple[str, Tensor]]:
        """Every HF tensor, TP shards gathered and PP stages broadcast: COLLECTIVE, every rank must exhaust it.

        Tied embeddings appear once, as `model.embed_tokens.weight` (the torch trainer's `named_parameters`
        convention); with pipeline parallelism the last stage's copy of the output layer is the same tensor and
        is skipped.
        """
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in self._bridge.export_weights(stages):
                if name in seen:
                    continue
                seen.add(name)
                yield name, tensor


def _bridge_class(family: str) -> type:
    from mbridge.core.bridge import _MODEL_REGISTRY

    base = _MODEL_REGISTRY[family]

    class LocalSpecBridge(base):  # type: ignore[misc, valid-type]
        _OTHER_MAPPING: ClassVar[dict[str, list[str]]] = {**base._OTHER_MAPPING, **_LOCAL_SPEC_NORMS["other"]}
        _MLP_MAPPING: ClassVar[dict[str, list[str]]] = {**base._MLP_MAPPING, **_LOCAL_SPEC_NORMS["mlp"]}

        def _adjust_mapping_for_shared_weights(self) -> None:
            self._DIRECT_MAPPING = dict(self._DIRECT_MAPPING)
            if getattr(self.hf_config, "tie_word_embeddings", False):
                self._DIRECT_MAPPING["output_layer.weight"] = "model.embed_tokens.weight"

        def _get_gptmodel_args(self) -> dict[str, Any]:
            raise NotImplementedError("HFBridge.build_stage builds the model; mbridge's provider is not used")

    LocalSpecBridge.__name__ = f"LocalSpec{base.__name__}"
    return LocalSpecBridge


def _config_overrides(dtype: torch.dtype) -> dict[str, Any]:
    """TransformerConfig settings that differ from mbridge's (which targets transformer-engine on GPUs)."""
    return {
        "sequence_parallel": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "gradient_accumulation_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # Initialisation is wasted work (HF weights overwrite it) but not skippable: megatron marks the
        # tensor-parallel attributes of its weights only while initialising them.
        "use_cpu_initialization": False,
        "perform_initialization": True,
        "calculate_per_token_loss": True,
        "variable_seq_lengths": True,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
    }


def _rope_arguments(hf_config: PretrainedConfig) -> dict[str, Any]:
    parameters = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = parameters.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("model config has no rope_theta (neither in rope_parameters nor at top level)")
    arguments: dict[str, Any] = {"rotary_base": theta}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "llama3":
        arguments.update(rope_scaling=True, rope_scaling_factor=float(parameters["factor"]))
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported by the Megatron backend (default, llama3)")
    return arguments


def _refuse_unsupported(hf_config: PretrainedConfig, path: Path) -> None:
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError(f"{path}: mlp_bias=True is not supported by the Megatron backend")
    if hf_config.model_type == "qwen3" and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{path}: qwen3 with attention_bias=True is not supported by the Megatron backend")
