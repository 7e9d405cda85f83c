"""Megatron's own model and training flags, as slime's run scripts pass them through to Megatron.

Field names are Megatron's flag names (`--num-layers` is `num_layers`), defaults are Megatron's (megatron-core
0.16.1, Megatron-LM's `arguments.py`), except in two cases said in the field: a model-shape flag defaults to None
("take it from the HF checkpoint": we build the model from its config.json and only CHECK the flag against it,
`engines.megatron.model_flags.check_against_hf`), and a setting where Slipstream's behaviour differs from
Megatron's default (dropout, sequence parallelism, fp32 gradient reduction) defaults to None ("ours"). Flags that
already have a home elsewhere stay there (`--bf16` in `model`, `--lr`, `--adam-beta1`, `--weight-decay`,
`--tensor-model-parallel-size` ... in `trainer`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from actors.config.plugin_marks import plugin_for
from actors.config.sections import Section

_SHAPE = "model shape, checked against the HF checkpoint (default: the checkpoint's)"


class MegatronConfig(Section):
    """Megatron's model-shape, parallelism, recompute, optimizer and kernel flags (slime passes them to Megatron)."""

    # -- model shape: checked against the HF config.json, never used to build -----------------------------------
    num_layers: int | None = Field(None, ge=1, description=f"transformer layers; {_SHAPE}")
    hidden_size: int | None = Field(None, ge=1, description=f"hidden size; {_SHAPE}")
    ffn_hidden_size: int | None = Field(None, ge=1, description=f"MLP hidden size; {_SHAPE}")
    num_attention_heads: int | None = Field(None, ge=1, description=f"attention heads; {_SHAPE}")
    group_query_attention: bool | None = Field(None, description=f"grouped-query attention; {_SHAPE}")
    num_query_groups: int | None = Field(None, ge=1, description=f"key/value heads under GQA; {_SHAPE}")
    kv_channels: int | None = Field(None, ge=1, description=f"head dimension; {_SHAPE}")
    swiglu: bool | None = Field(None, description=f"gated SiLU MLP; {_SHAPE}")
    normalization: Literal["LayerNorm", "RMSNorm"] | None = Field(None, description=f"norm type; {_SHAPE}")
    norm_epsilon: float | None = Field(None, gt=0, description=f"norm epsilon (Megatron: 1e-5); {_SHAPE}")
    apply_layernorm_1p: bool | None = Field(None, description=f"zero-centred norm weights; {_SHAPE}")
    qk_layernorm: bool | None = Field(None, description=f"norms on queries and keys; {_SHAPE}")
    vocab_size: int | None = Field(None, ge=1, description=f"vocabulary before padding; {_SHAPE} after padding "
                                   "both by --make-vocab-size-divisible-by x TP")
    make_vocab_size_divisible_by: int = Field(128, ge=1, description="Megatron's vocabulary padding multiple (used "
                                              "to compare --vocab-size with the checkpoint)")
    untie_embeddings_and_output_weights: bool | None = Field(None, description=f"separate output layer; {_SHAPE}")
    disable_bias_linear: bool | None = Field(None, description=f"no biases in linear layers; {_SHAPE}")
    add_qkv_bias: bool | None = Field(None, description=f"biases on q, k, v only; {_SHAPE}")
    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "mrope", "relative", "none"] | None = Field(
        None, description=f"position embedding (Megatron: learned_absolute); {_SHAPE} (rope)")
    use_rotary_position_embeddings: bool | None = Field(None, description="deprecated spelling of "
                                                        "--position-embedding-type rope")
    no_position_embedding: bool | None = Field(None, description="no learned absolute position embedding (RoPE "
                                               "models have none)")
    rotary_base: float | None = Field(None, gt=0, description=f"RoPE theta (Megatron: 10000); {_SHAPE}")
    rotary_percent: float | None = Field(None, gt=0, le=1, description=f"fraction of head dims rotated; {_SHAPE}")
    rotary_interleaved: bool | None = Field(None, description=f"interleaved RoPE pairs; {_SHAPE}")
    use_rope_scaling: bool | None = Field(None, description=f"llama3.x RoPE scaling; {_SHAPE}")
    rotary_scaling_factor: float | None = Field(None, gt=0, description="YaRN scaling factor (multi-latent "
                                                "attention; not checked)")
    max_position_embeddings: int | None = Field(None, ge=1, description=f"position table size; {_SHAPE}")
    seq_length: int | None = Field(None, ge=1, description="Megatron's fixed sequence length (unused: we pack "
                                   "variable-length rows)")
    padded_vocab_size: int | None = Field(None, ge=1, description="Megatron's padded vocabulary; must hold the "
                                          "checkpoint's vocab_size")
    micro_batch_size: int = Field(1, ge=1, description="samples per micro-batch (accepted; micro-batches are packed "
                                  "by token budget instead, --micro-batch-tokens)")
    mtp_num_layers: int | None = Field(None, ge=0, description="multi-token-prediction (MTP) depths, trained with "
                                       "--enable-mtp-training (torch backend)")
    mtp_loss_scaling_factor: float = Field(0.2, ge=0, description="weight of the MTP loss, over the depth count "
                                           "(megatron's scale)")
    enable_mtp_training: bool = Field(False, description="train MTP layers beside the policy, a speculative-decoding "
                                      "draft the policy gets no gradient from (torch backend; docs/slime.md)")
    custom_model_provider_path: str | None = Field(None, description="module:function building the Megatron model "
                                                   "(not supported: the model is built from the HF checkpoint)")
    async_save: bool = Field(False, description="accepted; checkpoints are written synchronously")
    # Architectures our Megatron bridge does not build (refused there; checked where the HF config says).
    multi_latent_attention: bool | None = Field(None, description=f"DeepSeek multi-latent attention; {_SHAPE}")
    q_lora_rank: int | None = Field(None, ge=1, description=f"MLA query rank; {_SHAPE}")
    kv_lora_rank: int | None = Field(None, ge=1, description=f"MLA key/value rank; {_SHAPE}")
    qk_head_dim: int | None = Field(None, ge=1, description=f"MLA q/k head dim without RoPE; {_SHAPE}")
    qk_pos_emb_head_dim: int | None = Field(None, ge=1, description=f"MLA q/k RoPE head dim; {_SHAPE}")
    v_head_dim: int | None = Field(None, ge=1, description=f"MLA value head dim; {_SHAPE}")
    mscale: float | None = Field(None, description="MLA YaRN mscale (not checked)")
    mscale_all_dim: float | None = Field(None, description="MLA YaRN mscale_all_dim (not checked)")
    attention_output_gate: bool | None = Field(None, description="gated attention output (Qwen3-Next); not built "
                                               "by the Megatron backend")
    use_gated_attention: bool | None = Field(None, description="gated attention (Qwen3-Next); not built by the "
                                             "Megatron backend")
    post_mlp_layernorm: bool | None = Field(None, description="norm after the MLP; not built by the Megatron "
                                            "backend")
    post_self_attn_layernorm: bool | None = Field(None, description="norm after attention; not built by the "
                                                  "Megatron backend")
    spec: list[str] | None = Field(None, description="MODULE FUNCTION of a custom layer spec (refused: the Megatron "
                                   "backend picks the spec)")
    # -- mixture of experts (Megatron backend: Qwen3-MoE, engines/megatron/experts.py) --------------------------
    num_experts: int | None = Field(None, ge=1, description=f"experts per MoE layer; {_SHAPE}")
    moe_router_topk: int | None = Field(None, ge=1, description=f"experts per token; {_SHAPE}")
    moe_ffn_hidden_size: int | None = Field(None, ge=1, description=f"expert MLP hidden size; {_SHAPE}")
    moe_shared_expert_intermediate_size: int | None = Field(None, ge=1, description=f"shared experts' size; {_SHAPE}")
    moe_layer_freq: int | str | None = Field(None, description="MoE layer pattern (N or a Python list expression)")
    moe_shared_expert_gate: bool | None = Field(None, description="gate on the shared expert")
    moe_router_score_function: Literal["softmax", "sigmoid"] | None = Field(None, description="router scores")
    moe_router_pre_softmax: bool | None = Field(None, description="softmax before top-k")
    moe_router_topk_scaling_factor: float | None = Field(None, description="scale of the top-k routing weights")
    moe_router_load_balancing_type: str | None = Field(None, description="aux_loss, seq_aux_loss, sinkhorn, none")
    moe_router_enable_expert_bias: bool | None = Field(None, description="aux-loss-free expert bias")
    moe_router_bias_update_rate: float | None = Field(None, ge=0, description="expert bias update rate")
    moe_router_num_groups: int | None = Field(None, ge=1, description="expert groups for group-limited routing")
    moe_router_group_topk: int | None = Field(None, ge=1, description="groups chosen per token")
    moe_router_dtype: Literal["fp32", "fp64"] | None = Field(None, description="router precision")
    moe_aux_loss_coeff: float | None = Field(None, ge=0, description="load-balancing loss weight (megatron's, per "
                                             "layer, summed; torch backend: engines/training/moe.py)")
    moe_z_loss_coeff: float | None = Field(None, ge=0, description="router z-loss weight (torch backend as above)")
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] | None = Field(None, description="token "
                                                                                          "dispatcher")
    moe_token_drop_policy: Literal["probs", "position"] | None = Field(None, description="which tokens to drop")
    moe_grouped_gemm: bool | None = Field(None, description="grouped GEMM for experts")
    moe_permute_fusion: bool | None = Field(None, description="fused token permutation")
    moe_enable_deepep: bool | None = Field(None, description="DeepEP dispatcher")
    # -- parallelism beyond --tensor/--pipeline-model-parallel-size -------------------------------------------
    context_parallel_size: int = Field(1, ge=1, description="learner ranks each packed row is split across "
                                       "(the torch backend; all-gather layout, docs/long-context.md)")
    expert_model_parallel_size: int = Field(1, ge=1, description="expert parallel size: experts split over this "
                                            "many data-parallel learner ranks (Megatron backend)")
    expert_tensor_parallel_size: int | None = Field(None, ge=1, description="expert tensor parallel size (Megatron: "
                                                    "the TP size; 1 or the TP size)")
    decoder_first_pipeline_num_layers: int | None = Field(None, ge=0, description="layers of the first pipeline "
                                                          "stage (uneven stages: not supported yet)")
    decoder_last_pipeline_num_layers: int | None = Field(None, ge=0, description="layers of the last pipeline "
                                                         "stage (uneven stages: not supported yet)")
    sequence_parallel: bool | None = Field(None, description="split activations over TP ranks (Megatron: off; "
                                           "ours: on wherever it can be, i.e. transformer-engine and TP > 1; "
                                           "--no-sequence-parallel turns it off)")
    # -- activation recompute (torch backend: any granularity turns on gradient checkpointing) -----------------
    recompute_granularity: Literal["full", "selective"] | None = Field(None, description="activation recompute")
    recompute_method: Literal["uniform", "block"] | None = Field(None, description="how --recompute-granularity "
                                                                 "full chooses layers")
    recompute_num_layers: int | None = Field(None, ge=1, description="layers per recompute unit (uniform) or "
                                             "recomputed layers per stage (block)")
    # -- optimizer (lr, betas, weight decay, clipping: the trainer section) ---------------------------------------
    optimizer: str = Field("adam", description="Megatron's optimizer name (only adam, i.e. AdamW, is supported)")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon (both backends)")
    lr_warmup_fraction: float | None = Field(None, ge=0, le=1, description="LR warmup as a fraction of "
                                             "--num-rollout steps (instead of --lr-warmup-iters)")
    optimizer_cpu_offload: bool = Field(False, description="optimizer state on the CPU (not supported)")
    overlap_cpu_optimizer_d2h_h2d: bool = Field(False, description="overlap of the CPU optimizer's copies (not "
                                                "supported)")
    use_precision_aware_optimizer: bool = Field(False, description="transformer-engine's precision-aware Adam (not "
                                                "supported)")
    # -- precision, kernels, dropout ---------------------------------------------------------------------------
    fp16: bool = Field(False, description="fp16 training with loss scaling (not supported; use --bf16)")
    fp8_format: Literal["e4m3", "hybrid"] | None = Field(None, description="FP8 training's number format (not "
                                                         "supported: the trainers train in --bf16)")
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] | None = Field(
        None, description="FP8 training's scaling recipe (not supported, as --fp8-format)")
    transformer_impl: Literal["local", "transformer_engine"] | None = Field(
        None, description="accepted; the Megatron backend picks its layer spec itself (transformer-engine's where "
        "it is installed, the local one otherwise)")
    accumulate_allreduce_grads_in_fp32: bool | None = Field(None, description="gradients accumulated and reduced "
                                                            "in float32 (ours: always)")
    attention_softmax_in_fp32: bool | None = Field(None, description="attention softmax in float32 (megatron-core: "
                                                   "on)")
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = Field(
        "auto", description="transformer-engine attention kernel (the local spec always uses torch SDPA)")
    attention_dropout: float | None = Field(None, ge=0, lt=1, description="attention dropout (Megatron: 0.1; ours: "
                                            "0, as the HF configs of our families say)")
    hidden_dropout: float | None = Field(None, ge=0, lt=1, description="hidden-state dropout (Megatron: 0.1; "
                                         "ours: 0)")
    no_masked_softmax_fusion: bool = Field(False, description="turn off the fused masked softmax")
    no_rope_fusion: bool = Field(False, description="turn off the fused RoPE kernel")
    no_gradient_accumulation_fusion: bool = Field(False, description="turn off apex's fused weight-gradient "
                                                  "accumulation")
    deterministic_mode: bool = Field(False, description="deterministic kernels on every learner rank, either "
                                     "backend (torch.use_deterministic_algorithms; Megatron's deterministic_mode): "
                                     "the same batches train to the same weights, bit for bit")
    no_check_for_nan_in_loss_and_grad: bool = Field(False, description="accepted; the trainer always checks the "
                                                    "gradient norm and skips a non-finite step")
    use_dist_ckpt: bool = Field(False, description="accepted; Megatron checkpoints are always distributed here")
    enable_experimental: bool = Field(False, description="accepted; no experimental megatron feature is used")
    # -- slime's hooks into its Megatron backend ---------------------------------------------------------------
    custom_megatron_init_path: str | None = Field(None, description="module:function called as fn(args) on every "
                                                  "learner rank once megatron is initialised, before the model is "
                                                  "built (args: a namespace of the run's flat settings)",
                                                  json_schema_extra=plugin_for("learner"))
    custom_megatron_before_log_prob_hook_path: str | None = Field(
        None, description="module:function called as fn(args, model, store_prefix) on every learner rank before "
        "each log-prob pass (model: the list of model chunks; store_prefix: '' for old, 'ref_' for reference "
        "log-probs); --train-backend megatron only", json_schema_extra=plugin_for("learner"))
    custom_megatron_before_train_step_hook_path: str | None = Field(
        None, description="module:function called as fn(args, rollout_id, step_id, model, optimizer, "
        "opt_param_scheduler) on every learner rank before each optimizer step, gradients zeroed (step_id: the "
        "step within the rollout batch; opt_param_scheduler: None, the trainer schedules the lr itself); "
        "--train-backend megatron only", json_schema_extra=plugin_for("learner"))

    @model_validator(mode="after")
    def _mtp_training_needs_depths(self) -> MegatronConfig:
        if self.enable_mtp_training and not self.mtp_num_layers:
            raise ValueError("--enable-mtp-training needs --mtp-num-layers N (the MTP depths to train), as in slime")
        return self

    def set_flags(self) -> dict[str, object]:
        """The flags as `engines.megatron.model_flags` reads them: unset ones (None) left out."""
        return self.model_dump(exclude_none=True)
