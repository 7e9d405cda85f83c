"""Trainer log-probs and entropy against a plain Hugging Face forward of each sequence on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

TEMPERATURE = 0.7


def _samples(count: int = 6, seed: int = 0) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = int(torch.randint(4, 40, (1,), generator=generator))
        response = int(torch.randint(1, length, (1,), generator=generator))
        samples.append(TrainSample(torch.randint(6, 100, (length,), generator=generator), response))
    return samples


def _reference(model_path: Path, samples: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T) at each response token, and that distribution's entropy, one sequence at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    log_probs, entropies = [], []
    with torch.no_grad():
        for sample in samples:
            logits = model(sample.tokens.unsqueeze(0)).logits[0, :-1] / TEMPERATURE
            distribution = torch.log_softmax(logits, dim=-1)[-sample.response_length :]
            targets = sample.tokens[-sample.response_length :]
            log_probs.append(distribution.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
            entropies.append(-(distribution.exp() * distribution).sum(-1))
    return torch.cat(log_probs), torch.cat(entropies)


@pytest.fixture(scope="module")
def ref_model_path(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen2", seed=1))


@pytest.fixture(scope="module")
def trainer(tiny_model_path: Path, ref_model_path: Path) -> TorchTrainer:
    # A budget of 64 tokens packs several samples per row and splits the batch into several micro-batches.
    config = TorchTrainerConfig(model_path=tiny_model_path, ref_model_path=ref_model_path, micro_batch_tokens=64)
    return TorchTrainer(config)


@pytest.mark.unit
def test_log_probs_equal_a_plain_hf_forward_per_sequence(trainer: TorchTrainer, tiny_model_path: Path) -> None:
    samples = _samples()
    expected, _ = _reference(tiny_model_path, samples)
    outputs = trainer.compute_log_probs(samples, temperature=TEMPERATURE)
    assert outputs.entropy is None
    torch.testing.assert_close(outputs.log_probs, expected, atol=1e-5, rtol=0)


@pytest.mark.unit
def test_entropy_is_that_of_the_tempered_distribution(trainer: TorchTrainer, tiny_model_path: Path) -> None:
    samples = _samples(seed=1)
    _, expected = _reference(tiny_model_path, samples)
    outputs = trainer.compute_log_probs(samples, temperature=TEMPERATURE, with_entropy=True)
    torch.testing.assert_close(outputs.entropy, expected, atol=1e-5, rtol=0)


@pytest.mark.unit
def test_ref_model_scores_with_its_own_weights(
    trainer: TorchTrainer, tiny_model_path: Path, ref_model_path: Path
) -> None:
    samples = _samples(seed=2)
    expected, _ = _reference(ref_model_path, samples)
    ref = trainer.compute_log_probs(samples, temperature=TEMPERATURE, model="ref").log_probs
    policy = trainer.compute_log_probs(samples, temperature=TEMPERATURE).log_probs
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(ref, policy, atol=1e-3)


@pytest.mark.unit
def test_ref_scoring_without_a_ref_model_is_a_clear_error(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))
    with pytest.raises(ValueError, match="needs ref_model_path"):
        trainer.compute_log_probs(_samples(count=1), temperature=1.0, model="ref")


@pytest.mark.unit
def test_missing_model_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"model path {tmp_path}: no config.json"):
        TorchTrainer(TorchTrainerConfig(model_path=tmp_path))
