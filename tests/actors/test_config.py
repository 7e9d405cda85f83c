"""The run config: YAML, flags over YAML, slime switches, errors that name the key."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from actors.config import (
    RunConfig,
    add_config_flags,
    build_config,
    config_from_args,
    split_sglang_args,
    write_effective_config,
)
from actors.rollout.engine_factory import colocated_release_tags, sglang_server_args
from actors.runtime.context import ActorContext, ActorSettings
from actors.slime_compat.args import build_args


def parse(argv: list[str], base: dict | None = None):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    remaining, passthrough = split_sglang_args(argv)
    args = parser.parse_args(remaining)
    args.sglang_passthrough = passthrough
    return config_from_args(args, base=base)


@pytest.mark.unit
def test_flags_override_the_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rollout_batch_size: 16\nlr: 0.001\neps_clip_high: 0.28\n", encoding="utf-8")
    config = parse(["--config", str(path), "--lr", "0.01"])
    assert config.rollout.rollout_batch_size == 16
    assert config.trainer.lr == 0.01
    assert config.policy.eps_clip_high == 0.28


@pytest.mark.unit
def test_unknown_yaml_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rollout_batch_size: 16\nlearning_rate: 0.1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown key.*learning_rate"):
        parse(["--config", str(path)])


@pytest.mark.unit
def test_slime_switches_reach_the_policy() -> None:
    config = parse(["--disable-grpo-std-normalization", "--advantage-estimator", "grpo"])
    assert config.policy.grpo_std_normalization is False
    assert parse([]).policy.off_policy_correction == "tis"  # the fully-async default
    assert parse(["--off-policy-correction", "none"]).policy.off_policy_correction == "none"


@pytest.mark.unit
def test_a_runs_policy_defaults_are_the_same_however_the_run_is_configured(tmp_path: Path) -> None:
    """The correction's one default (PolicyLossConfig's): the flags, a config file, the settings API, a RunConfig
    built bare and the library all read it; an SFT loss takes none, a slime entry point slime's meaning."""
    from actors.config import RunConfig, build_config
    from policies.config import PolicyLossConfig

    path = tmp_path / "run.yaml"
    path.write_text("rollout_batch_size: 16\n", encoding="utf-8")
    for config in (parse([]), parse(["--config", str(path)]), build_config({}), RunConfig(),
                   RunConfig(policy={"eps_clip": 0.3})):
        assert config.policy.off_policy_correction == PolicyLossConfig().off_policy_correction == "tis"
    assert parse(["--loss-type", "sft"]).policy.off_policy_correction == "none"
    assert build_config({"loss_type": "sft_loss"}).policy.off_policy_correction == "none"
    assert parse(["--slime-entry", "train"]).policy.off_policy_correction == "none"
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert "(default: tis" in next(action.help for action in parser._actions if action.dest == "off_policy_correction")


@pytest.mark.unit
@pytest.mark.parametrize("flag", ["--deterministic-inference", "--sglang-enable-deterministic-inference"])
def test_either_spelling_of_deterministic_inference_reaches_every_engine(flag: str) -> None:
    """slime's pass-through spelling makes the torch engine batch-invariant too, and ours starts SGLang with it."""
    config = parse(["--rollout-engine", "sglang", flag])
    assert config.engine.deterministic_inference
    assert sglang_server_args(config)["enable-deterministic-inference"] == "true"
    assert build_args(config).sglang_enable_deterministic_inference is True  # what a slime plugin reads
    default = parse(["--rollout-engine", "sglang"])
    assert not default.engine.deterministic_inference
    assert "enable-deterministic-inference" not in sglang_server_args(default)


@pytest.mark.unit
def test_a_colocated_sglang_server_saves_memory_and_hands_over_only_what_comes_back() -> None:
    colocated = parse(["--rollout-engine", "sglang", "--colocate"])
    assert sglang_server_args(colocated)["enable-memory-saver"] == "true"
    assert colocated_release_tags(colocated) == ("kv_cache", "cuda_graph")  # weights would come back as garbage
    backed_up = parse(["--rollout-engine", "sglang", "--colocate", "--sglang-enable-weights-cpu-backup"])
    assert colocated_release_tags(backed_up) == ("weights", "kv_cache", "cuda_graph")
    adapter = parse(["--rollout-engine", "sglang", "--colocate", "--sglang-enable-weights-cpu-backup",
                     "--lora-rank", "8"])
    assert colocated_release_tags(adapter) == ("kv_cache", "cuda_graph")  # an adapter push never rewrites the base
    apart = parse(["--rollout-engine", "sglang"])
    assert colocated_release_tags(apart) == () and "enable-memory-saver" not in sglang_server_args(apart)


@pytest.mark.unit
def test_cross_field_errors_name_the_fields() -> None:
    with pytest.raises(ValueError, match="global_batch_size 3 must divide rollout_batch_size x n_samples_per_prompt"):
        build_config({"rollout_batch_size": 4, "n_samples_per_prompt": 2, "global_batch_size": 3})
    with pytest.raises(ValueError, match="kl_coef"):
        build_config({"kl_coef": 0.1, "use_kl_loss": True, "kl_loss_coef": 0.1})
    with pytest.raises(ValueError, match="rollout_batch_size"):
        build_config({"rollout_batch_size": "many"})
    with pytest.raises(ValueError, match=r"max_staleness 0 must be at least update_weights_interval - 1 = 2"):
        build_config({"max_staleness": 0, "update_weights_interval": 3})
    assert build_config({"max_staleness": 2, "update_weights_interval": 3}).weights.update_weights_interval == 3


@pytest.mark.unit
def test_config_round_trips_through_the_actor_settings() -> None:
    config = parse(["--eps-clip-high", "0.3", "--max-staleness", "0"])
    context = ActorContext(actor_id="buffer", role="buffer", actor_class="x:Y", node_rank=0,
                           head_address="tcp://127.0.0.1:1", run_dir=Path("run"), settings=ActorSettings(run=config))
    again = ActorContext.from_json(context.to_json())
    assert again.settings.run == config and again.settings.run.buffer.max_staleness == 0


@pytest.mark.unit
def test_actor_settings_refuse_a_misspelt_or_mistyped_setting() -> None:
    with pytest.raises(ValueError, match="stream_windw"):
        ActorSettings.model_validate({"stream_windw": 8})
    with pytest.raises(ValueError, match="stream_window"):
        ActorSettings.model_validate({"stream_window": 0})


@pytest.mark.unit
def test_each_setting_lives_in_the_section_of_the_component_that_reads_it() -> None:
    config = build_config({"lr": 1e-5, "max_staleness": 0, "rollout_top_p": 0.9, "weight_transport": "gloo"})
    assert (config.trainer.lr, config.buffer.max_staleness, config.rollout.rollout_top_p,
            config.weights.weight_transport) == (1e-5, 0, 0.9, "gloo")
    assert RunConfig(lr=1e-5) == RunConfig(trainer={"lr": 1e-5})  # flat names are routed to their section
    assert config.with_settings(lr=2e-5).trainer.lr == 2e-5 and config.trainer.lr == 1e-5
    with pytest.raises(ValueError, match=r"min_lr 0\.1 must be in"):
        config.with_settings(min_lr=0.1)  # a copy is validated like a new config


@pytest.mark.unit
def test_a_field_constraint_names_the_setting_and_its_value() -> None:
    with pytest.raises(ValueError, match=r"^rollout_top_p 1\.5: must be <= 1\.0$"):
        build_config({"rollout_top_p": 1.5})
    with pytest.raises(ValueError, match=r"^max_staleness -1: must be >= 0$"):
        build_config({"max_staleness": -1})


@pytest.mark.unit
def test_the_written_config_yaml_starts_the_same_run_again(tmp_path: Path) -> None:
    config = parse(["--lr", "0.003", "--rollout-batch-size", "3", "--kl-coef", "0.01"])
    path = write_effective_config(config, tmp_path)
    assert "trainer:" in path.read_text()  # written by section
    assert parse(["--config", str(path)]) == config
    path.write_text("trainer:\n  lr: 0.1\n  learning_rate: 0.2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown key\(s\) in section 'trainer': learning_rate"):
        parse(["--config", str(path)])


@pytest.mark.unit
def test_a_worker_nodes_flags_override_the_heads_settings(tmp_path: Path) -> None:
    head = parse(["--hf-checkpoint", "/models/m", "--rollout-batch-size", "3", "--lr", "0.003"])
    path = tmp_path / "node.yaml"
    path.write_text("lr: 0.005\n", encoding="utf-8")
    worker = parse(["--config", str(path), "--rollout-batch-size", "5"], base=head.model_dump(mode="json"))
    assert worker.model.hf_checkpoint == "/models/m"
    assert (worker.rollout.rollout_batch_size, worker.trainer.lr) == (5, 0.005)
    assert parse([], base=head.model_dump(mode="json")) == head
    with pytest.raises(ValueError, match=r"the head's settings: unknown key\(s\) in section 'trainer': lr_v2"):
        parse([], base={"trainer": {"lr_v2": 1.0}})


@pytest.mark.unit
def test_sglang_prefixed_flags_reach_the_server_arguments(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("sglang_args:\n  mem-fraction-static: '0.5'\n  log-level: warning\n", encoding="utf-8")
    config = parse(["--config", str(path), "--sglang-mem-fraction-static", "0.7", "--sglang-enable_torch_compile",
                    "--sglang-chunked-prefill-size=512", "--lr", "0.01"])
    assert config.engine.sglang_args == {"mem-fraction-static": "0.7", "log-level": "warning",
                                  "enable-torch-compile": "true", "chunked-prefill-size": "512"}
    assert config.trainer.lr == 0.01


@pytest.mark.unit
def test_model_parallel_sizes_must_divide_the_learner_ranks() -> None:
    with pytest.raises(ValueError, match="learner_ranks 3 must be a positive multiple"):
        build_config({"train_backend": "megatron", "learner_ranks": 3, "tensor_model_parallel_size": 2})
    with pytest.raises(ValueError, match="needs --train-backend megatron"):
        build_config({"learner_ranks": 2, "tensor_model_parallel_size": 2})
    config = build_config({"train_backend": "megatron", "learner_ranks": 4, "tensor_model_parallel_size": 2})
    assert config.trainer.learner_ranks // config.trainer.tensor_model_parallel_size == 2


@pytest.mark.unit
def test_our_own_sglang_settings_are_flags_not_server_arguments() -> None:
    config = parse(["--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server",
                    "--sglang-url", "http://a:1", "http://b:2", "--sglang-startup-timeout=30",
                    "--sglang-mem-fraction-static", "0.5"])
    assert config.engine.sglang_server_module == "tools.standins.sglang_server"
    assert config.engine.sglang_url == ["http://a:1", "http://b:2"]
    assert config.engine.sglang_startup_timeout == 30.0
    assert config.engine.sglang_args == {"mem-fraction-static": "0.5"}


@pytest.mark.unit
def test_a_run_naming_the_stand_in_server_where_it_used_to_live_starts_the_one_that_lives_now() -> None:
    with pytest.warns(FutureWarning, match="engines.sglang.server moved to tools.standins.sglang_server"):
        config = parse(["--rollout-engine", "sglang", "--sglang-server-module", "engines.sglang.server"])
    assert config.engine.sglang_server_module == "tools.standins.sglang_server"


@pytest.mark.unit
def test_min_lr_is_where_the_cosine_schedule_ends(tmp_path: Path) -> None:
    from actors.learner.trainer_factory import _shared_settings
    from engines.training.config import TrainerOptimizerConfig
    from engines.training.schedule import lr_multiplier

    config = parse(["--hf-checkpoint", str(tmp_path), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style",
                    "cosine", "--num-rollout", "100"])
    trainer_config = TrainerOptimizerConfig(**_shared_settings(config))
    final = config.trainer.lr * lr_multiplier(100, schedule="cosine", total_steps=trainer_config.total_steps,
                                      min_lr_ratio=trainer_config.min_lr_ratio)
    assert final == pytest.approx(1e-5)
    with pytest.raises(ValueError, match=r"min_lr 0.001 must be in \[0, lr=0.0001\]"):
        parse(["--lr", "1e-4", "--min-lr", "1e-3"])


@pytest.mark.integration
def test_bf16_reaches_the_trainer_the_engine_the_push_and_a_launched_sglang_server(tiny_model_path: Path) -> None:
    """slime's --bf16 is one flag for four places: the trainer computes in bfloat16 over float32 master weights, the
    torch engine serves bfloat16, the weights travel as bfloat16, and a launched SGLang server loads bfloat16
    (else it follows the checkpoint's dtype, which a fine-tuned checkpoint often saved as float32)."""
    import asyncio

    import torch

    from actors.learner.publish import push_dtype
    from actors.learner.trainer_factory import build_trainer
    from actors.rollout.engine_factory import load_engine

    config = parse(["--hf-checkpoint", str(tiny_model_path), "--bf16"])
    trainer = build_trainer(config)
    try:
        assert trainer.config.dtype == "bfloat16"
        assert {tensor.dtype for _, tensor in trainer.named_tensors()} == {torch.float32}  # the master weights
    finally:
        trainer.close()
    engine, _ = load_engine(config, "rollout-0-0")
    try:
        assert {p.dtype for p in engine._model.parameters()} == {torch.bfloat16}
    finally:
        asyncio.run(engine.close())
    assert push_dtype(config) is torch.bfloat16
    assert sglang_server_args(parse(["--rollout-engine", "sglang", "--bf16"]))["dtype"] == "bfloat16"
    assert sglang_server_args(parse(["--rollout-engine", "sglang", "--bf16", "--sglang-dtype", "float16"]))[
        "dtype"] == "float16"  # the user's own choice stands
    float32 = parse(["--hf-checkpoint", str(tiny_model_path)])
    assert push_dtype(float32) is None and "dtype" not in sglang_server_args(float32)


@pytest.mark.unit
def test_a_vision_language_checkpoint_takes_the_dynamic_layout_on_a_gpu(tmp_path: Path) -> None:
    """The static pool does not take images yet (the engine refuses them there): auto must not pick it."""
    import json

    import torch

    from actors.rollout.engine_factory import torch_kv_cache

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    cuda = torch.device("cuda", 0)
    assert torch_kv_cache(parse(["--hf-checkpoint", str(tmp_path)]), cuda) == "dynamic"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert torch_kv_cache(parse(["--hf-checkpoint", str(tmp_path)]), cuda) == "static"


@pytest.mark.unit
def test_the_torch_engine_takes_the_static_kv_pool_on_a_gpu_and_sized_by_the_runs_lengths() -> None:
    import torch

    from actors.rollout.engine_factory import kv_pool_columns, torch_kv_cache

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert torch_kv_cache(parse([]), cuda) == "static"
    assert torch_kv_cache(parse([]), cpu) == "dynamic"
    assert torch_kv_cache(parse(["--deterministic-inference"]), cuda) == "dynamic"  # batch-invariant needs v1
    assert torch_kv_cache(parse(["--use-rollout-routing-replay"]), cuda) == "dynamic"  # v1 records the routes
    assert torch_kv_cache(parse(["--torch-kv-cache", "static"]), cpu) == "static"
    assert torch_kv_cache(parse(["--torch-kv-cache", "dynamic"]), cuda) == "dynamic"
    assert kv_pool_columns(parse([])) == 4096
    assert kv_pool_columns(parse(["--rollout-max-prompt-len", "3000", "--rollout-max-response-len", "2000"])) == 5000
    assert kv_pool_columns(parse(["--rollout-max-context-len", "8192", "--eval-max-context-len", "12000"])) == 12000
    assert kv_pool_columns(parse(["--rollout-max-context-len", "8192", "--torch-kv-pool-columns", "1024"])) == 1024


@pytest.mark.integration
def test_a_run_asking_for_the_static_kv_cache_gets_an_engine_on_the_pool(tiny_model_path: Path) -> None:
    import asyncio

    from actors.rollout.engine_factory import load_engine
    from engines.inference.static_batcher import StaticBatcher

    engine, _ = load_engine(parse(["--hf-checkpoint", str(tiny_model_path), "--torch-kv-cache", "static",
                                   "--rollout-max-context-len", "300"]), "rollout-0-0")
    try:
        assert isinstance(engine._batcher, StaticBatcher)
        assert engine._batcher.pool.columns == 300
    finally:
        asyncio.run(engine.close())


@pytest.mark.integration
@pytest.mark.parametrize(("flags", "chunk"), [([], 8192), (["--torch-prefill-chunk-tokens", "2048"], 2048)])
def test_the_prefill_chunk_flag_bounds_the_engines_prefill_forwards(tiny_model_path: Path, flags: list[str],
                                                                    chunk: int) -> None:
    import asyncio

    from actors.rollout.engine_factory import load_engine

    engine, _ = load_engine(parse(["--hf-checkpoint", str(tiny_model_path), *flags]), "rollout-0-0")
    try:
        assert engine._batcher.limits.prefill_chunk_tokens == chunk
    finally:
        asyncio.run(engine.close())


@pytest.mark.unit
def test_a_prefill_chunk_below_one_token_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^--torch-prefill-chunk-tokens 0: must be >= 1$"):
        parse(["--torch-prefill-chunk-tokens", "0"])


@pytest.mark.integration
@pytest.mark.parametrize(("flags", "budget"), [([], 1024 << 20), (["--torch-prefix-cache-mb", "8"], 8 << 20),
                                               (["--no-torch-prefix-cache"], None),
                                               (["--sglang-disable-radix-cache", "true"], None)])
def test_the_prefix_cache_flags_size_the_engines_cache_or_switch_it_off(tiny_model_path: Path, flags: list[str],
                                                                        budget: int | None) -> None:
    import asyncio

    from actors.rollout.engine_factory import load_engine

    engine, _ = load_engine(parse(["--hf-checkpoint", str(tiny_model_path), *flags]), "rollout-0-0")
    try:
        cache = engine._batcher.prefix_cache
        assert (cache.budget_bytes if cache is not None else None) == budget
    finally:
        asyncio.run(engine.close())


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "reason"), [
    (["--train-backend", "tools.sim.pipeline:sleeping_trainer"],
     "MoE routes are replayed by --train-backend torch or megatron; --train-backend tools.sim"),
    (["--rollout-engine", "tools.sim.pipeline:sleeping_engine"], "torch engines and SGLang servers record routed"),
    (["--torch-kv-cache", "static"], "static KV cache does not record routed experts yet"),
])
def test_rollout_routing_replay_is_refused_where_no_engine_records_routes(flags: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse(["--use-rollout-routing-replay", *flags])


@pytest.mark.unit
def test_slimes_own_dynamic_sampling_filter_is_ours() -> None:
    from actors.config.sections import SLIME_NONZERO_STD_FILTER

    assert parse(["--dynamic-sampling-filter-path", SLIME_NONZERO_STD_FILTER]).buffer.dynamic_sampling_filter_path \
        == "nonzero_std"
