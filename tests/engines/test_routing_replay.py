"""MoE routing replay on the torch backend: a policy forward routes each token where its sample says, whatever the
packing, and the routers still learn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from engines.training import ModelOutputs, PackedBatch, TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.lora import LoraSettings
from engines.training.micro_batches import pack_inputs
from engines.training.moe import Routers, sample_routes
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model


@pytest.fixture(scope="module")
def moe_model(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe", experts=8))


def groups(seed: int = 0) -> list[TrainSample]:
    """Three groups sharing their prompts, as the learner packs them, of several response lengths."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for prompt_length, responses in ((6, (3, 5, 2)), (9, (4, 4)), (4, (6, 1, 3))):
        prompt = torch.randint(6, 100, (prompt_length,), generator=generator)
        for length in responses:
            samples.append(TrainSample(torch.cat([prompt, torch.randint(6, 100, (length,), generator=generator)]),
                                       length))
    return samples


def recorded(trainer: TorchTrainer, samples: list[TrainSample], *, share_prompts: bool = True) -> list[Tensor]:
    """Each sample's routes as the trainer's policy chooses them, from one packed forward."""
    routers = Routers(trainer._model, wanted_by="test")
    inputs = pack_inputs(samples, share_prompts=share_prompts, with_token_positions=True)
    with torch.no_grad(), routers.tapped() as layers:
        trainer._model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False)
    return sample_routes(layers, samples, inputs)


def with_routes(samples: list[TrainSample], routes: list[Tensor]) -> list[TrainSample]:
    return [TrainSample(s.tokens, s.response_length, routed_experts=r) for s, r in zip(samples, routes, strict=True)]


@pytest.mark.integration
@pytest.mark.parametrize("shared_when_recorded", [True, False])
def test_replaying_a_models_own_routes_under_another_packing_changes_nothing(moe_model: Path,
                                                                            shared_when_recorded: bool) -> None:
    """Routes recorded from one row, replayed in rows cut differently (a small token budget, prompts shared where
    they were not and the other way round): any token given another token's experts would change its log-prob."""
    samples = groups()
    trainer = TorchTrainer(TorchTrainerConfig(model_path=moe_model, micro_batch_tokens=20,
                                              share_prompts=not shared_when_recorded))
    routes = recorded(trainer, samples, share_prompts=shared_when_recorded)
    assert [r.shape for r in routes] == [(s.tokens.numel() - 1, 2, 2) for s in samples]
    plain = trainer.compute_log_probs(samples, temperature=1.0).log_probs
    replayed = trainer.compute_log_probs(with_routes(samples, routes), temperature=1.0).log_probs
    torch.testing.assert_close(replayed, plain, atol=1e-5, rtol=0)


@pytest.mark.integration
def test_replayed_routes_decide_the_experts_and_the_reference_routes_for_itself(moe_model: Path) -> None:
    """With LoRA the reference is the policy's own modules with the adapter off: replay must still skip it."""
    samples = groups()
    trainer = TorchTrainer(TorchTrainerConfig(model_path=moe_model, ref_model_path=moe_model,
                                              lora=LoraSettings(rank=4, alpha=8)))
    own = recorded(trainer, samples)
    shifted = [(r + 1) % 8 for r in own]  # every token to other experts
    moved = trainer.compute_log_probs(with_routes(samples, shifted), temperature=1.0).log_probs
    plain = trainer.compute_log_probs(samples, temperature=1.0).log_probs
    assert (moved - plain).abs().mean() > 1e-3
    reference = trainer.compute_log_probs(with_routes(samples, shifted), temperature=1.0, model="ref").log_probs
    torch.testing.assert_close(reference, plain, atol=1e-5, rtol=0)


class _PolicyGradient:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        return -outputs.log_probs.sum() / self.tokens, {}


@pytest.mark.integration
def test_a_replayed_training_step_trains_the_routers_through_the_replayed_experts_weights(moe_model: Path) -> None:
    samples = groups()
    tokens = sum(s.response_length for s in samples)
    trainer = TorchTrainer(TorchTrainerConfig(model_path=moe_model, lr=1e-2))
    routes = [(r + 1) % 8 for r in recorded(trainer, samples)]
    before = {name: tensor.clone() for name, tensor in trainer.named_tensors() if "mlp.gate" in name}
    result = trainer.train_step(with_routes(samples, routes), _PolicyGradient(tokens), temperature=1.0)
    assert not result.skipped
    after = dict(trainer.named_tensors())
    assert all(not torch.equal(after[name], tensor) for name, tensor in before.items())


@pytest.mark.unit
def test_routes_that_do_not_fit_are_refused_naming_the_sample(moe_model: Path, tiny_model_path: Path) -> None:
    samples = groups()
    trainer = TorchTrainer(TorchTrainerConfig(model_path=moe_model))
    short = [TrainSample(s.tokens, s.response_length, routed_experts=torch.zeros(3, 2, 2, dtype=torch.int16))
             for s in samples]
    with pytest.raises(ValueError, match=r"sample 0: routed_experts must be integer experts of shape"):
        trainer.compute_log_probs(short, temperature=1.0)
    routes = recorded(trainer, samples)
    mixed = [*with_routes(samples[:2], routes[:2]), *samples[2:]]
    with pytest.raises(ValueError, match="carry no routes while others do"):
        trainer.compute_log_probs(mixed, temperature=1.0)
    dense = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path))
    with pytest.raises(ValueError, match="has no MoE router, but the samples carry routed_experts"):
        dense.compute_log_probs(with_routes(samples, routes), temperature=1.0)
