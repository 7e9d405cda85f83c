"""Router losses of mixture-of-experts models on the torch backend: megatron-core's own formulas, read from the
packed training forward, reaching the router weights, and configured by slime's flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func
from torch import Tensor

from actors.config import add_config_flags, config_from_args
from actors.learner.trainer_factory import build_trainer
from engines.training import ModelOutputs, PackedBatch, TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.attention import register_packed_attention
from engines.training.micro_batches import forward_packed, pack_inputs
from engines.training.moe import (
    RouterLosses,
    RouterLossSettings,
    Routers,
    load_balancing_loss,
    router_modules,
    z_loss,
)
from tools.standins.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer, cached_tiny_model

MOE_FAMILIES = ["qwen3_moe", "mixtral"]


def samples(lengths: list[int], response: int = 3, seed: int = 0) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(seed)
    return [TrainSample(torch.randint(6, 100, (length,), generator=generator), response) for length in lengths]


@pytest.mark.unit
def test_one_layers_losses_equal_megatron_cores() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 8, generator=generator) * 3
    chosen = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices
    routed = torch.bincount(chosen.reshape(-1), minlength=8).float()
    expected = switch_load_balancing_loss_func(torch.softmax(logits, -1), routed, total_num_tokens=37, topk=2,
                                               num_experts=8, moe_aux_loss_coeff=1.0)
    torch.testing.assert_close(load_balancing_loss(logits, chosen), expected)
    torch.testing.assert_close(z_loss(logits), z_loss_func(logits, 1.0))


@pytest.mark.integration
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_losses_of_a_packed_row_and_their_gradients_are_those_of_its_sequences_run_alone(family: str) -> None:
    """Read through hooks from the packed forward (sequences isolated inside one row), the loss and the router
    gradients must equal megatron's formulas over the same tokens taken from plain per-sequence forwards."""
    register_packed_attention()
    packed_model = build_tiny_model(TinyModelSpec(family=family), build_tokenizer())
    packed_model.config._attn_implementation = "packed_sdpa"
    plain_model = build_tiny_model(TinyModelSpec(family=family), build_tokenizer())
    settings = RouterLossSettings(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    routers = Routers(packed_model, wanted_by="test")
    losses = RouterLosses(routers, settings)
    batch = samples([7, 11, 5])
    with routers.tapped() as layers:
        forward_packed(packed_model, pack_inputs(batch, share_prompts=False))
    ours, metrics = losses.loss(layers, micro_batches=1)
    ours.backward()

    per_layer: list[list[Tensor]] = []
    for sample in batch:
        output = plain_model(input_ids=sample.tokens[None], output_router_logits=True, use_cache=False)
        per_layer.append(list(output.router_logits))
    expected = torch.zeros(())
    aux_values = []
    for layer_logits in zip(*per_layer, strict=True):
        logits = torch.cat(layer_logits)
        probs = torch.softmax(logits.float(), -1)
        top_k = plain_model.config.num_experts_per_tok
        routed = torch.bincount(torch.topk(probs, top_k, -1).indices.reshape(-1), minlength=probs.shape[-1]).float()
        aux = switch_load_balancing_loss_func(probs, routed, total_num_tokens=logits.shape[0], topk=top_k,
                                              num_experts=probs.shape[-1], moe_aux_loss_coeff=1.0)
        aux_values.append(float(aux))
        expected = expected + 0.01 * aux + z_loss_func(logits, 0.001)
    expected.backward()
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    assert metrics["moe/load_balancing_loss"] == pytest.approx(sum(aux_values) / len(aux_values), rel=1e-5)
    for ours_router, plain_router in zip(router_modules(packed_model), router_modules(plain_model), strict=True):
        assert ours_router.weight.grad is not None and ours_router.weight.grad.abs().sum() > 0
        torch.testing.assert_close(ours_router.weight.grad, plain_router.weight.grad, atol=1e-7, rtol=1e-4)


class _NoPolicyGradient:
    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        return (outputs.log_probs * 0.0).sum(), {}


@pytest.mark.integration
def test_a_trainer_step_moves_the_routers_by_the_aux_loss_alone(tiny_model_cache: Path) -> None:
    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    moved = {}
    for coeff in (0.0, 0.1):
        trainer = TorchTrainer(TorchTrainerConfig(model_path=model, lr=1e-2, weight_decay=0.0,
                                                  moe_aux_loss_coeff=coeff))
        before = {name: tensor.clone() for name, tensor in trainer.named_tensors()}
        result = trainer.train_step(samples([9, 6, 8, 12]), _NoPolicyGradient(), temperature=1.0)
        after = dict(trainer.named_tensors())
        moved[coeff] = {name for name, tensor in after.items() if not torch.equal(tensor, before[name])}
        assert ("moe/load_balancing_loss" in result.metrics) == (coeff > 0)
    assert moved[0.0] == set()
    # the aux loss reaches the routers, and through their inputs the layers below them; never the output head
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} <= moved[0.1]
    assert "lm_head.weight" not in moved[0.1]


@pytest.mark.integration
def test_a_dense_model_with_router_loss_flags_is_refused_by_name(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match=r"moe-aux-loss-coeff.*no MoE router"):
        TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, moe_aux_loss_coeff=0.01))


def slime_config(model: Path, *flags: str) -> Any:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(["--hf-checkpoint", str(model), "--train-backend", "torch", *flags]))


@pytest.mark.integration
def test_slimes_router_flags_reach_the_torch_trainer_and_other_balancing_types_are_refused(
        tiny_model_cache: Path) -> None:
    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    trainer = build_trainer(slime_config(model, "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"))
    assert trainer.config.moe_aux_loss_coeff == 0.01 and trainer.config.moe_z_loss_coeff == 0.001
    off = build_trainer(slime_config(model, "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type",
                                     "none"))
    assert off.config.moe_aux_loss_coeff == 0.0
    with pytest.raises(ValueError, match="moe-router-load-balancing-type sinkhorn"):
        build_trainer(slime_config(model, "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type",
                                   "sinkhorn"))
