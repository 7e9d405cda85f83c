"""The Megatron backend's MoE pieces that need no parallel world: names, layouts, settings and refusals."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from actors.config import add_config_flags, config_from_args
from engines.megatron import experts
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytest.importorskip("megatron.core")


def parse_run_config(argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_tiny_model(tmp_path_factory.mktemp("moe"), TinyModelSpec(family="qwen3_moe"))


@pytest.mark.unit
def test_sequential_mlp_names_become_mbridges_grouped_names_with_the_global_expert() -> None:
    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert experts.grouped_expert_name(local) == "decoder.layers.1.mlp.experts.linear_fc1.weight1"
    assert experts.grouped_expert_name(local, expert_offset=2) == "decoder.layers.1.mlp.experts.linear_fc1.weight3"
    assert experts.is_local_expert_weight(local)
    router = "decoder.layers.1.mlp.router.weight"
    assert experts.grouped_expert_name(router, expert_offset=2) == router
    assert not experts.is_local_expert_weight(router)


@pytest.mark.unit
def test_the_router_is_megatrons_form_of_the_hf_router(moe_path: Path) -> None:
    """norm_topk_prob decides where megatron takes the softmax; router losses are off unless slime's flags ask."""
    hf_config = AutoConfig.from_pretrained(moe_path)
    assert experts.moe_overrides(hf_config, {}, grouped_gemm=False)["moe_router_pre_softmax"] is True
    hf_config.norm_topk_prob = True
    settings = experts.moe_overrides(hf_config, {"moe_aux_loss_coeff": 0.01}, grouped_gemm=False)
    assert settings["moe_router_pre_softmax"] is False and settings["moe_aux_loss_coeff"] == 0.01
    assert settings["moe_z_loss_coeff"] is None
    off = experts.moe_overrides(hf_config, {"moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": "none"},
                                grouped_gemm=False)
    assert off["moe_aux_loss_coeff"] == 0.0
    hf_config.mlp_only_layers = [0]
    with pytest.raises(ValueError, match=r"dense layers between MoE layers \(mlp_only_layers=\[0\]"):
        experts.moe_overrides(hf_config, {}, grouped_gemm=False)


@pytest.mark.unit
def test_checkpoints_move_between_expert_parallel_sizes_above_one_only() -> None:
    assert experts.checkpoint_expert_parallel_problem(2, 4) is None
    assert experts.checkpoint_expert_parallel_problem(1, 1) is None
    problem = experts.checkpoint_expert_parallel_problem(2, 1)
    assert problem is not None and "saved at expert_model_parallel_size 2 and cannot load at 1" in problem


@pytest.mark.unit
def test_expert_parallelism_must_fit_the_learner_ranks() -> None:
    base = ["--train-backend", "megatron", "--expert-model-parallel-size", "2"]
    with pytest.raises(ValueError, match=r"learner_ranks 1 over pipeline_model_parallel_size 1 must be a multiple "
                                         r"of expert_tensor_parallel_size x expert_model_parallel_size = 2"):
        parse_run_config(base)
    assert parse_run_config([*base, "--actor-num-gpus-per-node", "2"]).megatron.expert_model_parallel_size == 2
