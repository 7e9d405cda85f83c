"""Hugging Face <-> megatron-core weights and model construction, on top of mbridge.

Choice of bridge. mbridge 0.15.1 is pure Python over megatron-core and installs without any other dependency
(einops aside), so it works on a CPU-only torch; it knows the Llama, Qwen2 and Qwen3 layouts (fused QKV with
grouped heads, fused gate/up, TP split and merge, pipeline broadcast). megatron-bridge 0.3.1 requires
transformer-engine (CUDA-only, builds against torch at install time) and pins transformers 4.x, so it cannot
install next to our stack. We therefore use mbridge for the name and layout mapping and its load/export
routines, and add only what our configuration differs in:

- the layer spec: transformer-engine's (`get_gpt_layer_with_transformer_engine_spec`: fused layernorm-linear,
  flash/cuDNN attention) wherever TE imports on a CUDA machine, which is the layout mbridge maps natively; else
  megatron's LOCAL spec with `engines.megatron.attention.SdpaAttention` as its core attention (torch's fused
  SDPA instead of a materialised score matrix). The local spec's norms are separate modules (`input_layernorm`,
  `pre_mlp_layernorm`) instead of being fused into `linear_qkv`/`linear_fc1`, so two name mappings are added;
  both specs share one distributed-checkpoint layout (the local spec maps its norm keys onto TE's);
- tied embeddings: mbridge's Qwen2 bridge rewrites a CLASS-level mapping dict for tied models (leaking into
  later untied instances in the same process), and its Llama bridge does not handle ties at all; we keep the
  mapping per instance;
- rope parameters: transformers 5 moved `rope_theta` into `rope_parameters`, which mbridge does not read;
- mixture-of-experts layers (`engines.megatron.experts`): the local spec's SequentialMLP experts under mbridge's
  grouped names, loaded over the expert-TP group, and the router and MoE settings of the checkpoint;
- the TransformerConfig: no dropout, per-token loss scaling (see `engines.megatron.trainer`), and the kernels
  the runtime has (`Runtime`, `config_overrides`): on a GPU sequence parallelism (TP > 1, TE spec) and the fused
  kernels megatron's own training enables; on the CPU (`cpu_compat`) none of them, since they are CUDA kernels;
  then the Megatron flags the run gave (`engines.megatron.model_flags`: recompute, dropout, ...), which win.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from engines.megatron import experts
from engines.megatron.model_flags import MegatronFlags, check_against_hf, run_init_hook, transformer_overrides
from engines.megatron.parallel import compute_device
from engines.weights import layouts

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", *experts.MOE_FAMILIES)
_LOCAL_SPEC_NORMS = {
    "other": {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]},
    "mlp": {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]},
}


@dataclass(frozen=True)
class Runtime:
    """What the machine offers megatron: CUDA, transformer-engine, apex's fused weight-gradient kernel."""

    cuda: bool
    transformer_engine: bool
    apex_gradient_fusion: bool

    @classmethod
    def detect(cls) -> Runtime:
        cuda = torch.cuda.is_available()
        transformer_engine = False
        if cuda:
            from megatron.core.models.gpt import gpt_layer_specs

            transformer_engine = bool(gpt_layer_specs.HAVE_TE)  # megatron's own import of TE succeeded
        from megatron.core.tensor_parallel import layers

        # The flag megatron's linears check before accepting gradient_accumulation_fusion.
        apex = cuda and bool(layers._grad_accum_fusion_available)
        return cls(cuda=cuda, transformer_engine=transformer_engine, apex_gradient_fusion=apex)

    @property
    def layer_spec(self) -> Literal["transformer_engine", "local"]:
        return "transformer_engine" if self.cuda and self.transformer_engine else "local"


class HFBridge:
    """One HF architecture seen from megatron: its TransformerConfig, its GPTModel stages, and its weights.

    Construct after megatron's parallel state is initialised (mbridge reads TP/PP ranks from it).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        runtime: Runtime | None = None,
        flags: MegatronFlags | None = None,
    ) -> None:
        """`flags`: Megatron's flags from the run (checked against the checkpoint, mapped onto the
        TransformerConfig) and the init hook, which runs here: megatron is initialised, no model is built yet."""
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
        if getattr(self.hf_config, "head_dim", None) is None:  # Mixtral leaves it to the model; mbridge reads it
            self.hf_config.head_dim = self.hf_config.hidden_size // self.hf_config.num_attention_heads
        from megatron.core import parallel_state

        tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
        flags = flags or MegatronFlags()
        check_against_hf(flags.flags, self.hf_config, tensor_parallel=tensor_parallel)
        if flags.init_hook_path:
            run_init_hook(flags.init_hook_path, flags.namespace())  # the one namespace the step hooks get too
        vocab = self.hf_config.vocab_size
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        self._bridge = _bridge_class(family)(
            self.hf_config,
            dtype=dtype,
            make_vocab_size_divisible_by=tensor_parallel if vocab % tensor_parallel else None,
        )
        self.runtime = Runtime.detect() if runtime is None else runtime
        overrides = config_overrides(dtype, self.runtime, tensor_parallel)
        if experts.is_moe(self.hf_config):
            experts.define_missing_te_gemm()
            overrides |= experts.moe_overrides(self.hf_config, flags.flags,
                                               grouped_gemm=self.runtime.layer_spec == "transformer_engine")
            # megatron trains MoE layers under TP only with the rows split over the TP ranks (`experts`).
            overrides["sequence_parallel"] = tensor_parallel > 1
        # Flags the user gave win over our defaults (recompute, dropout, fusions turned off, ...).
        overrides |= transformer_overrides(flags.flags, layer_spec=self.runtime.layer_spec)
        self._bridge.set_extra_args(**overrides)
        self.vocab_size = vocab
        self.padded_vocab_size = math.ceil(vocab / tensor_parallel) * tensor_parallel
        self._model_layout = (layouts.ModelLayout(self.hf_config)
                              if experts.is_moe(self.hf_config) and layouts.stacks_experts(self.hf_config) else None)

    @property
    def transformer_config(self) -> Any:
        return self._bridge.config

    @property
    def sequence_parallel(self) -> bool:
        """Whether megatron splits rows over the TP ranks (their width must then be a multiple of TP)."""
        return bool(self._bridge.config.sequence_parallel)

    def build_stage(self) -> nn.Module:
        """This rank's pipeline stage of the GPT model, with the layer spec `Runtime.layer_spec` names."""
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel

        config = self._bridge.config
        spec = layer_spec(self.runtime, config)
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
        # megatron's linears allocate on the current GPU, but the local spec's norms are torch modules made on the
        # CPU. The policy's reach the GPU only when the distributed optimizer copies every parameter into its CUDA
        # buffer; a frozen reference model, or a run without that optimizer, kept them on the CPU.
        return model.to(compute_device())

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

    def model_layout_weights(self, stages: list[nn.Module]) -> Iterator[tuple[str, Tensor]]:
        """`export_hf_weights` under the names and shapes of the HF model in memory, which is what engines serve
        and the torch trainer sends: the same tensors but a MoE layer's experts stacked (`experts`). COLLECTIVE."""
        weights = self.export_hf_weights(stages)
        return weights if self._model_layout is None else self._model_layout(weights)


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

        # Experts of the local spec (SequentialMLP) under mbridge's grouped names: see `engines.megatron.experts`.
        _loading_dense_only = False

        def _weight_name_mapping_mcore_local_to_global(self, model: nn.Module, consider_ep: bool = True
                                                       ) -> dict[str, str]:
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=consider_ep)
            offset = 0
            if consider_ep and self.mpu.ep_size > 1:
                offset = self.mpu.ep_rank * (self.config.num_moe_experts // self.mpu.ep_size)
            return {local: experts.grouped_expert_name(name, expert_offset=offset) for local, name in names.items()
                    if not (self._loading_dense_only and experts.is_local_expert_weight(local))}

        def load_weights(self, models: list[nn.Module], weights_path: str, memory_efficient: bool = False) -> None:
            """mbridge's load for everything but SequentialMLP experts, which it would read on TP rank 0 and scatter
            over the attention's TP group; an expert is split over the EXPERT TP group, whose rank 0 reads it."""
            self._loading_dense_only = True
            try:
                super().load_weights(models, weights_path, memory_efficient)
            finally:
                self._loading_dense_only = False
            for model in models:
                self._load_local_experts(model)

        def _load_local_experts(self, model: nn.Module) -> None:
            import torch.distributed as dist

            state = model.state_dict()
            for local, name in self._weight_name_mapping_mcore_local_to_global(model).items():
                if not experts.is_local_expert_weight(local):
                    continue
                param = state[local]
                shards = None
                if self.mpu.etp_rank == 0:
                    hf_names = self._weight_name_mapping_mcore_to_hf(name)
                    whole = self._weight_to_mcore_format(local, [self.safetensor_io.load_one_hf_weight(hf_name)
                                                                 for hf_name in hf_names])
                    shards = [shard.to(param.device, dtype=param.dtype).contiguous() for shard in
                              self._weight_split_across_tp(local, whole, param, self.mpu.etp_size)]
                if self.mpu.etp_size == 1:
                    param.copy_(shards[0])
                    continue
                received = torch.empty_like(param)
                dist.scatter(received, shards, src=dist.get_global_rank(self.mpu.etp_group, 0),
                             group=self.mpu.etp_group)
                param.copy_(received)

        def _weight_merge_across_tp(self, name: str, weights: list[Tensor], param: Tensor) -> Tensor:
            whole = experts.expert_merge(weights, self.mpu.etp_size) if experts.is_expert_weight(name) else None
            return whole if whole is not None else super()._weight_merge_across_tp(name, weights, param)

    LocalSpecBridge.__name__ = f"LocalSpec{base.__name__}"
    return LocalSpecBridge


def layer_spec(runtime: Runtime, config: Any) -> Any:
    """transformer-engine's GPT layer spec where TE runs, else megatron's local spec with SDPA attention (and,
    with sequence parallelism, norms that allow it: `experts.SequenceParallelRMSNorm`). MoE layers are
    transformer-engine's grouped experts under TE, megatron's SequentialMLP otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    moe = {"num_experts": config.num_moe_experts, "moe_grouped_gemm": bool(config.moe_grouped_gemm)}
    if runtime.layer_spec == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **moe)
    from engines.megatron.attention import SdpaAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm",
                                                    **moe)
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = experts.SequenceParallelRMSNorm
    if config.qk_layernorm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = experts.SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=experts.SequenceParallelRMSNorm)


def config_overrides(dtype: torch.dtype, runtime: Runtime, tensor_parallel: int) -> dict[str, Any]:
    """TransformerConfig settings that differ from mbridge's defaults, for this runtime.

    Always: no dropout (log-probs must be a function of the weights), per-token loss scaling and variable row
    lengths (module docstring of `engines.megatron.trainer`), the compute dtype. On the CPU every fused kernel
    and sequence parallelism are off: they are CUDA kernels (`cpu_compat` maps devices, not kernels). On a GPU
    the fusions megatron's training turns on by default are on where their kernels exist: bias-SwiGLU and
    bias-dropout-add (megatron's jit fusions), RoPE fusion (transformer-engine's kernel) and weight-gradient
    accumulation into `main_grad` (apex's kernel). Sequence parallelism follows mbridge (TP > 1) under the TE spec;
    the local spec's torch norms refuse it.
    """
    overrides: dict[str, Any] = {
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
    if not runtime.cuda:
        return overrides | {
            "sequence_parallel": False,
            "masked_softmax_fusion": False,
            "bias_activation_fusion": False,
            "bias_dropout_fusion": False,
            "gradient_accumulation_fusion": False,
            "apply_rope_fusion": False,
            "persist_layer_norm": False,
        }
    te = runtime.layer_spec == "transformer_engine"
    return overrides | {
        "sequence_parallel": te and tensor_parallel > 1,
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
        "apply_rope_fusion": te,
        # megatron's own linears (the output layer, even under the TE spec) refuse this flag without apex's
        # `fused_weight_gradient_mlp_cuda`: TE alone is not enough.
        "gradient_accumulation_fusion": runtime.apex_gradient_fusion,
        "persist_layer_norm": False,  # apex's persistent LayerNorm; our models use RMSNorm
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
