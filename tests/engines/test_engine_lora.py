"""The torch engine serves a LoRA run's policy from adapter-only updates: merged weights, no drift, clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.lora import LoraSettings, merged_state_dict
from tests.support.training import loss_fn

pytestmark = pytest.mark.integration
ADAPTER = LoraSettings(rank=4, alpha=8.0)
PROMPT = [7, 12, 30, 41, 9]


def _samples(seed: int) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(4):
        tokens = torch.randint(6, 100, (20,), generator=generator)
        samples.append(TrainSample(tokens, 12, advantages=torch.randn(12, generator=generator)))
    return samples


def _trainer(model_path: Path) -> TorchTrainer:
    return TorchTrainer(TorchTrainerConfig(model_path=model_path, lr=3e-2, micro_batch_tokens=64,
                                           check_packing=False, lora=ADAPTER))


def _step(trainer: TorchTrainer, seed: int) -> None:
    trainer.train_step(_samples(seed), loss_fn(_samples(seed)), temperature=1.0)


def _policy_greedy(trainer: TorchTrainer, tokens: int) -> list[int]:
    sequence, output = list(PROMPT), []
    model = trainer._model.eval()
    with torch.no_grad():
        for _ in range(tokens):
            token = int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())
            output.append(token)
            sequence.append(token)
    return output


async def _engine_greedy(engine: TorchEngine, tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    (output,) = await engine.generate(GenerateRequest(request_id="r", input_ids=PROMPT, params=params))
    return list(output.output_ids)


def _weights(engine: TorchEngine) -> dict[str, Tensor]:
    return {name: tensor.detach().clone() for name, tensor in engine.model.state_dict().items()}


async def test_adapter_updates_serve_the_trained_policy_version_after_version(tiny_model_path: Path) -> None:
    trainer = _trainer(tiny_model_path)
    engine = TorchEngine.from_pretrained(tiny_model_path, lora_scaling=ADAPTER.scaling)
    try:
        for version in (1, 2, 3):
            _step(trainer, version)
            await engine.update_weights(trainer.named_tensors(), version)
            served = _weights(engine)
            for name, expected in merged_state_dict(trainer._model).items():
                torch.testing.assert_close(served[name], expected, atol=1e-6, rtol=1e-6, msg=name)
        assert engine.version == 3
        assert await _engine_greedy(engine, 12) == _policy_greedy(trainer, 12)
    finally:
        await engine.close()


async def test_an_adapter_split_over_buckets_merges_the_same(tiny_model_path: Path) -> None:
    trainer = _trainer(tiny_model_path)
    _step(trainer, 0)
    whole = TorchEngine.from_pretrained(tiny_model_path, lora_scaling=ADAPTER.scaling)
    split = TorchEngine.from_pretrained(tiny_model_path, lora_scaling=ADAPTER.scaling)
    try:
        named = list(trainer.named_tensors())
        await whole.update_weights(named, 1)
        # Every A in one bucket, every B in the next: between the two the engine is paused, after them it is right.
        await split.update_weights([item for item in named if ".lora_A." in item[0]], 1)
        await split.update_weights([item for item in named if ".lora_B." in item[0]], 1)
        expected = _weights(whole)
        for name, tensor in _weights(split).items():
            assert torch.equal(tensor, expected[name]), name
    finally:
        await whole.close()
        await split.close()


async def test_adapter_updates_that_cannot_apply_are_refused_and_change_nothing(tiny_model_path: Path) -> None:
    trainer = _trainer(tiny_model_path)
    _step(trainer, 0)
    named = dict(trainer.named_tensors())
    without_settings = TorchEngine.from_pretrained(tiny_model_path)
    engine = TorchEngine.from_pretrained(tiny_model_path, lora_scaling=ADAPTER.scaling)
    try:
        with pytest.raises(ValueError, match="started without LoRA settings"):
            await without_settings.update_weights(named.items(), 1)
        before = _weights(engine)
        a_name = "model.layers.0.self_attn.q_proj.lora_A.weight"
        cases = {
            "the model has no linear layer 'model.layers.9.self_attn.q_proj'":
                [("model.layers.9.self_attn.q_proj.lora_A.weight", named[a_name])],
            "the layer takes 64 inputs": [(a_name, torch.zeros(4, 10))],
            "lora_A has rank 4, lora_B rank 3":
                [(a_name, named[a_name]), ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(64, 3))],
        }
        for message, bad in cases.items():
            # A bad tensor among good ones: nothing of the update applies.
            with pytest.raises(ValueError, match=message):
                await engine.update_weights([*named.items(), *bad], 1)
        assert engine.version == 0
        for name, tensor in _weights(engine).items():
            assert torch.equal(tensor, before[name]), name
    finally:
        await without_settings.close()
        await engine.close()
