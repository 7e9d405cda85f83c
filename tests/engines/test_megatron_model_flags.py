"""Megatron's model and training flags from a slime script: parsed into the `megatron` section, checked against
the HF checkpoint, mapped onto the TransformerConfig, or refused with the flag and the reason."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from actors.config import add_config_flags, build_config, config_from_args
from actors.learner.trainer_factory import build_trainer
from engines.megatron.model_flags import (
    MegatronFlags,
    check_against_hf,
    padded_vocab_size,
    refuse_unsupported,
    transformer_overrides,
)

# MODEL_ARGS of a slime script written for the tiny Qwen2 checkpoint (tests/conftest.py: tiny_model_path).
TINY_QWEN2_MODEL_ARGS = [
    "--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--vocab-size", "102",
    "--untie-embeddings-and-output-weights", "--max-position-embeddings", "512", "--position-embedding-type", "rope",
]
PERF_ARGS = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--sequence-parallel", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash",
             "--optimizer", "adam", "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
             "--expert-tensor-parallel-size", "1", "--use-dist-ckpt"]


def parse(argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.fixture
def hf_config(tiny_model_path: Path) -> Any:
    return AutoConfig.from_pretrained(tiny_model_path)


@pytest.mark.unit
def test_a_slime_scripts_megatron_flags_parse_into_the_megatron_section() -> None:
    config = parse(TINY_QWEN2_MODEL_ARGS + PERF_ARGS)
    megatron = config.megatron
    assert (megatron.num_layers, megatron.num_query_groups, megatron.rotary_base) == (2, 2, 10000.0)
    assert megatron.swiglu and megatron.untie_embeddings_and_output_weights and megatron.sequence_parallel
    assert (megatron.recompute_granularity, megatron.recompute_method, megatron.recompute_num_layers) == (
        "full", "uniform", 1)
    assert build_config({"num_layers": 2}).megatron.num_layers == 2  # YAML keys route the same way
    assert parse([]).megatron.num_layers is None  # model shape: the checkpoint's unless given


@pytest.mark.unit
def test_flags_matching_the_checkpoint_pass(hf_config: Any) -> None:
    check_against_hf(parse(TINY_QWEN2_MODEL_ARGS).megatron.set_flags(), hf_config)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("num_layers", 3, ("--num-layers 3", "num_hidden_layers=2")),
        ("hidden_size", 128, ("--hidden-size 128", "hidden_size=64")),
        ("ffn_hidden_size", 64, ("--ffn-hidden-size 64", "intermediate_size=176")),
        ("num_query_groups", 4, ("--num-query-groups 4", "num_key_value_heads=2")),
        ("group_query_attention", False, ("--group-query-attention False", "num_key_value_heads=2")),
        ("kv_channels", 32, ("--kv-channels 32", "head_dim=16")),
        ("rotary_base", 1e6, ("--rotary-base 1000000.0", "rope_theta=10000.0")),
        ("norm_epsilon", 1e-5, ("--norm-epsilon 1e-05", "rms_norm_eps=1e-06")),
        ("normalization", "LayerNorm", ("--normalization LayerNorm", "RMSNorm")),
        ("untie_embeddings_and_output_weights", False, ("--untie-embeddings-and-output-weights False",
                                                        "tie_word_embeddings=False")),
        ("qk_layernorm", True, ("--qk-layernorm True", "model_type 'qwen2'")),
        ("add_qkv_bias", False, ("--add-qkv-bias False", "attention_bias=True")),
        ("max_position_embeddings", 4096, ("--max-position-embeddings 4096", "max_position_embeddings=512")),
        ("num_experts", 8, ("--num-experts 8", "num_experts=absent (a dense model)")),
        ("use_rope_scaling", True, ("--use-rope-scaling True", "rope_type=default")),
        ("padded_vocab_size", 64, ("--padded-vocab-size 64", "vocab_size=102")),
    ],
)
def test_a_flag_contradicting_the_checkpoint_names_both_values(
    hf_config: Any, flag: str, value: Any, named: tuple[str, str]
) -> None:
    with pytest.raises(ValueError, match="disagree with the HF checkpoint") as error:
        check_against_hf({flag: value}, hf_config)
    for text in named:
        assert text in str(error.value)


@pytest.mark.unit
def test_vocab_size_is_compared_after_megatrons_padding(hf_config: Any) -> None:
    assert hf_config.vocab_size == 102 and padded_vocab_size(102, 128, 2) == 256
    check_against_hf({"vocab_size": 120}, hf_config)  # both pad to 128 rows: the same embedding
    with pytest.raises(ValueError, match=r"--vocab-size 120 \(padded to 120 .*vocab_size=102 \(padded: 102\)"):
        check_against_hf({"vocab_size": 120, "make_vocab_size_divisible_by": 1}, hf_config)
    with pytest.raises(ValueError, match=r"--vocab-size 300 \(padded to 512 .* x TP 2\).*\(padded: 256\)"):
        check_against_hf({"vocab_size": 300}, hf_config, tensor_parallel=2)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
         "--context-parallel-size 2: megatron-core 0.16 splits attention across a context-parallel group only in "
         "Transformer Engine's attention"),
        (["--expert-tensor-parallel-size", "3", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
          "--train-backend", "megatron"],
         "expert_tensor_parallel_size 3: the Megatron backend splits experts like the attention"),
        (["--moe-router-load-balancing-type", "seq_aux_loss"], "computes megatron's micro-batch aux_loss only"),
        (["--moe-router-enable-expert-bias"], "aux-loss-free expert bias"),
        (["--moe-enable-deepep"], "DeepEP's dispatcher is CUDA-only"),
        (["--fp16"], "--fp16 True: fp16 training"),
        (["--optimizer", "sgd"], "--optimizer sgd: only adam"),
        (["--optimizer-cpu-offload"], "--optimizer-cpu-offload True: the Megatron trainer runs"),
        (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer True"),
        (["--multi-latent-attention"], "--multi-latent-attention True: this architecture"),
        (["--spec", "plugin.models", "get_spec"], "--spec ['plugin.models', 'get_spec']: the Megatron backend picks"),
        (["--decoder-last-pipeline-num-layers", "3"], "--decoder-last-pipeline-num-layers 3: uneven pipeline"),
        (["--no-accumulate-allreduce-grads-in-fp32"], "always accumulated and reduced in float32"),
        (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
        (["--recompute-method", "block"], "need --recompute-granularity full"),
        (["--mtp-num-layers", "1", "--enable-mtp-training"],
         "--mtp-num-layers 1: the Megatron backend builds no multi-token-prediction layers"),
        (["--custom-model-provider-path", "m:f"], "builds the model from the HF checkpoint"),
    ],
)
def test_what_the_megatron_backend_cannot_do_is_refused_with_the_flag(
    tiny_model_path: Path, argv: list[str], reason: str
) -> None:
    from engines.megatron.config import MegatronTrainerConfig

    config = parse(argv)
    flags = config.megatron.set_flags()
    with pytest.raises(ValueError) as error:
        MegatronTrainerConfig(model_path=tiny_model_path, model_flags=MegatronFlags(flags=flags),
                              tensor_model_parallel_size=config.trainer.tensor_model_parallel_size,
                              expert_tensor_parallel_size=config.megatron.expert_tensor_parallel_size)
    assert reason in str(error.value)


@pytest.mark.unit
def test_the_torch_backend_accepts_megatron_performance_flags_but_not_megatron_hooks() -> None:
    perf = parse(TINY_QWEN2_MODEL_ARGS + PERF_ARGS + ["--optimizer-cpu-offload"]).megatron.set_flags()
    refuse_unsupported(perf, megatron_core=False)  # nothing to act on: accepted
    for argv, reason in [(["--custom-megatron-init-path", "m:f"], "needs --train-backend megatron"),
                         (["--fp16"], "fp16 training"), (["--attention-dropout", "0.1"], "takes dropout from")]:
        with pytest.raises(ValueError, match=reason):
            refuse_unsupported(parse(argv).megatron.set_flags(), megatron_core=False)
    # context parallelism splits rows across the torch learner's ranks, as many as there are of them at most
    refuse_unsupported(parse(["--context-parallel-size", "2", "--actor-num-gpus-per-node", "4"]).megatron.set_flags(),
                       megatron_core=False)
    with pytest.raises(ValueError, match="learner_ranks 3 must be a multiple of context_parallel_size 2"):
        parse(["--context-parallel-size", "2", "--actor-num-gpus-per-node", "3"])
    with pytest.raises(ValueError, match="keeps every expert on every rank"):
        refuse_unsupported({"expert_model_parallel_size": 2}, megatron_core=False)
    with pytest.raises(ValueError, match="expert parallelism needs --train-backend megatron"):
        parse(["--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"])
    # MTP layers train here, and are built only to train (slime's assert: training them needs their count)
    refuse_unsupported(parse(["--mtp-num-layers", "1", "--enable-mtp-training"]).megatron.set_flags(),
                       megatron_core=False)
    with pytest.raises(ValueError, match="builds MTP layers only to train them: add --enable-mtp-training"):
        refuse_unsupported(parse(["--mtp-num-layers", "1"]).megatron.set_flags(), megatron_core=False)
    with pytest.raises(ValueError, match="--enable-mtp-training needs --mtp-num-layers N"):
        parse(["--enable-mtp-training"])


@pytest.mark.unit
def test_the_torch_backend_checks_model_args_against_the_checkpoint(tiny_model_path: Path) -> None:
    base = ["--hf-checkpoint", str(tiny_model_path), "--train-backend", "torch"]
    with pytest.raises(ValueError, match="--num-layers 28 but the HF checkpoint has num_hidden_layers=2"):
        build_trainer(parse([*base, "--num-layers", "28"]))
    trainer = build_trainer(parse([*base, *TINY_QWEN2_MODEL_ARGS, *PERF_ARGS, "--adam-eps", "1e-6",
                                   "--lr-warmup-fraction", "0.5", "--num-rollout", "4"]))
    settings = trainer.config  # type: ignore[attr-defined]
    assert settings.gradient_checkpointing and settings.eps == 1e-6 and settings.warmup_steps == 2


@pytest.mark.unit
def test_transformer_overrides_follow_the_flags() -> None:
    flags = parse([*PERF_ARGS, "--no-sequence-parallel", "--no-rope-fusion"]).megatron.set_flags()
    overrides = transformer_overrides(flags, layer_spec="transformer_engine")
    assert overrides["recompute_granularity"] == "full" and overrides["attention_backend"] == "flash"
    assert overrides["sequence_parallel"] is False and overrides["apply_rope_fusion"] is False
    # The local spec's attention is torch SDPA: there is no transformer-engine kernel to select.
    assert "attention_backend" not in transformer_overrides(flags, layer_spec="local")


@pytest.mark.unit
def test_flags_reach_the_transformer_config_and_the_init_hook_runs_before_the_build(
    megatron_world: None, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engines.megatron.bridge import HFBridge
    from engines.megatron.cpu_compat import maybe_cpu_compat

    (tmp_path / "my_megatron_init.py").write_text(
        "from megatron.core import parallel_state\n"
        "CALLS = []\n"
        "def init(args):\n"
        "    CALLS.append((args.num_layers, parallel_state.model_parallel_is_initialized()))\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = [*TINY_QWEN2_MODEL_ARGS, "--recompute-granularity", "full", "--recompute-method", "block",
            "--recompute-num-layers", "1", "--attention-dropout", "0.25", "--no-attention-softmax-in-fp32",
            "--deterministic-mode"]
    flags = MegatronFlags(flags=parse(argv).megatron.set_flags(), init_hook_path="my_megatron_init:init",
                          hook_args={"num_layers": 2})
    with maybe_cpu_compat():
        config = HFBridge(tiny_model_path, flags=flags).transformer_config
        with pytest.raises(ValueError, match="--num-layers 3 but the HF checkpoint has num_hidden_layers=2"):
            HFBridge(tiny_model_path, flags=MegatronFlags(flags={"num_layers": 3}))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
        "full", "block", 1)
    assert config.attention_dropout == 0.25 and config.hidden_dropout == 0.0  # unset: ours (no dropout)
    assert config.attention_softmax_in_fp32 is False and config.deterministic_mode is True
    import my_megatron_init  # type: ignore[import-not-found]

    assert my_megatron_init.CALLS == [(2, True)]


@pytest.mark.integration
def test_full_recompute_trains_to_the_same_gradients(tiny_model_path: Path) -> None:
    """--recompute-granularity full reaches megatron's layers and changes memory, not results."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig
    from tests.support.training import seeded_batch, step_loss

    grad_norms = []
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    for flags in ({}, recompute):
        trainer = MegatronTrainer(MegatronTrainerConfig(model_path=tiny_model_path, lr=1e-3,
                                                        model_flags=MegatronFlags(flags=flags)))
        try:
            granularity = trainer._bridge.transformer_config.recompute_granularity
            batch = seeded_batch()
            result = trainer.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True)
            grad_norms.append(result.grad_norm)
        finally:
            trainer.close()
    assert granularity == "full"
    assert grad_norms[1] == pytest.approx(grad_norms[0], rel=1e-6)
