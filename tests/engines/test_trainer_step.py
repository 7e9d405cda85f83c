"""One optimizer step: packed micro-batches equal one padded full-batch step; non-finite steps are skipped."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import pydantic
import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from engines.training import ModelOutputs, PackedBatch, TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.schedule import lr_multiplier

TEMPERATURE = 0.8
# eps=1 keeps AdamW's first update proportional to the gradient (with the default 1e-8 it is lr * sign(g),
# which turns float noise in a near-zero gradient into a full-size difference between two correct runs).
OPTIMIZER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1.0, "weight_decay": 0.1, "grad_clip": 0.05}


def _samples(count: int = 7, seed: int = 0) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = int(torch.randint(5, 48, (1,), generator=generator))
        response = int(torch.randint(1, length, (1,), generator=generator))
        mask = (torch.rand(response, generator=generator) > 0.2).float()
        samples.append(
            TrainSample(
                tokens=torch.randint(6, 100, (length,), generator=generator),
                response_length=response,
                advantages=torch.randn(response, generator=generator),
                loss_mask=mask,
            )
        )
    return samples


@dataclass(frozen=True)
class StepLoss:
    """A token-mean term and a sequence-mean term (each sequence's log-prob weighted by its advantage sum), each
    divided by the step's global counts."""

    loss_tokens: int
    sequences: int

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        assert batch.loss_mask is not None and batch.advantages is not None
        mask, index = batch.loss_mask, batch.sample_index()
        token_term = -(batch.advantages * outputs.log_probs * mask).sum() / self.loss_tokens
        per_sequence = torch.zeros(batch.num_samples).index_add(0, index, outputs.log_probs * mask)
        weights = torch.zeros(batch.num_samples).index_add(0, index, batch.advantages)
        sequence_term = (weights * per_sequence).sum() / self.sequences
        loss = token_term + 0.1 * sequence_term
        return loss, {"token_term": float(token_term.detach())}


def policy_loss(samples: list[TrainSample]) -> StepLoss:
    """The loss of a step on `samples`, its denominators counted on all of them before the step."""
    return StepLoss(loss_tokens=int(sum((s.loss_mask != 0).sum() for s in samples)), sequences=len(samples))


def _reference_step(model_path: Path, samples: list[TrainSample]) -> tuple[dict[str, Tensor], float]:
    """An independent full-batch step: right-padded batch with an attention mask, torch AdamW, torch clipping."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    width = max(s.tokens.numel() for s in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : sample.tokens.numel()] = sample.tokens
        attention[row, : sample.tokens.numel()] = 1
    logits = model(input_ids=input_ids, attention_mask=attention).logits / TEMPERATURE
    log_probs = []
    for row, sample in enumerate(samples):
        end = sample.tokens.numel()
        distribution = torch.log_softmax(logits[row, end - 1 - sample.response_length : end - 1], dim=-1)
        log_probs.append(distribution.gather(-1, sample.tokens[-sample.response_length :, None]).squeeze(-1))
    batch = PackedBatch(
        response_lengths=torch.tensor([s.response_length for s in samples]),
        advantages=torch.cat([s.advantages for s in samples]),
        loss_mask=torch.cat([s.loss_mask for s in samples]),
    )
    loss, _ = policy_loss(samples)(ModelOutputs(torch.cat(log_probs)), batch)
    loss.backward()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIMIZER["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=OPTIMIZER["lr"],
        betas=OPTIMIZER["betas"],
        eps=OPTIMIZER["eps"],
    )
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER["grad_clip"]))
    optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, grad_norm


@pytest.mark.unit
def test_packed_micro_batched_step_equals_one_padded_full_batch_step(tiny_model_path: Path) -> None:
    samples = _samples()
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, micro_batch_tokens=60, **OPTIMIZER))
    result = trainer.train_step(samples, policy_loss(samples), temperature=TEMPERATURE)
    expected, expected_norm = _reference_step(tiny_model_path, samples)
    assert result.metrics["micro_batches"] > 1
    assert not result.skipped
    assert result.version == trainer.version == 1
    assert result.grad_norm == pytest.approx(expected_norm, rel=1e-5)
    assert expected_norm > OPTIMIZER["grad_clip"]  # so clipping took part in the comparison
    for name, tensor in trainer.named_tensors():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.unit
def test_non_finite_loss_skips_the_update_and_says_why(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))
    before = {name: tensor.clone() for name, tensor in trainer.named_tensors()}

    def nan_loss(outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        return outputs.log_probs.sum() * float("nan"), {}

    result = trainer.train_step(_samples(count=3), nan_loss, temperature=1.0)
    assert result.skipped and "non-finite loss" in result.skip_reason
    assert result.version == trainer.version == 0
    for name, tensor in trainer.named_tensors():
        assert torch.equal(tensor, before[name]), name
    assert all(p.grad is None for p in trainer._model.parameters())


@pytest.mark.unit
def test_a_batch_with_no_trained_token_skips_the_update_and_says_so(tiny_model_path: Path) -> None:
    """0/0 is not a NaN to report, and Adam's momentum from an earlier step must not move the weights on it."""
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))
    trainer.train_step(_samples(count=3), policy_loss(_samples(count=3)), temperature=1.0)  # momentum to spend
    before = {name: tensor.clone() for name, tensor in trainer.named_tensors()}
    masked = [dataclasses.replace(s, loss_mask=torch.zeros_like(s.loss_mask)) for s in _samples(count=3)]
    result = trainer.train_step(masked, policy_loss(masked), temperature=1.0)
    assert result.skipped and result.skip_reason == "no trained tokens (every loss mask is 0)"
    assert result.version == trainer.version == 1
    for name, tensor in trainer.named_tensors():
        assert torch.equal(tensor, before[name]), name


class _InfiniteGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, value: Tensor) -> Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return torch.full_like(grad, float("inf"))


@pytest.mark.unit
def test_non_finite_gradient_skips_the_update_and_the_next_step_trains(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))

    def exploding(outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        return _InfiniteGradient.apply(outputs.log_probs).mean(), {}

    skipped = trainer.train_step(_samples(count=3), exploding, temperature=1.0)
    assert skipped.skipped and "non-finite gradient norm" in skipped.skip_reason
    assert math.isfinite(skipped.metrics["loss"])
    trained = trainer.train_step(_samples(count=3), policy_loss(_samples(count=3)), temperature=1.0)
    assert not trained.skipped and trained.version == 1


@pytest.mark.unit
def test_loss_without_gradient_path_is_a_clear_error(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))

    def detached(outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        return outputs.log_probs.detach().sum(), {}

    with pytest.raises(ValueError, match="no gradient path"):
        trainer.train_step(_samples(count=2), detached, temperature=1.0)


@pytest.mark.unit
def test_cosine_schedule_warms_up_peaks_and_decays_to_its_floor() -> None:
    def at(step: int) -> float:
        return lr_multiplier(step, schedule="cosine", warmup_steps=4, total_steps=20, min_lr_ratio=0.1)

    warmup = [at(step) for step in range(4)]
    decay = [at(step) for step in range(4, 21)]
    assert 0 < warmup[0] < warmup[-1] == 1.0 == decay[0]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert at(12) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert at(20) == at(100) == pytest.approx(0.1)


@pytest.mark.unit
def test_constant_schedule_is_flat_after_warmup() -> None:
    values = [lr_multiplier(step, schedule="constant", warmup_steps=2) for step in range(6)]
    assert values == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.unit
def test_cosine_without_total_steps_is_rejected_at_config_time(tiny_model_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match="needs total_steps"):
        TorchTrainerConfig(model_path=tiny_model_path, lr_schedule="cosine")


@pytest.mark.unit
def test_gradient_checkpointing_takes_the_same_step(tiny_model_path: Path) -> None:
    results = {}
    for checkpointing in (False, True):
        config = TorchTrainerConfig(
            model_path=tiny_model_path, gradient_checkpointing=checkpointing, check_packing=False, **OPTIMIZER
        )
        trainer = TorchTrainer(config)
        assert trainer._model.is_activation_checkpointing == checkpointing
        trainer.train_step(_samples(), policy_loss(_samples()), temperature=TEMPERATURE)
        results[checkpointing] = dict(trainer.named_tensors())
    for name, tensor in results[True].items():
        torch.testing.assert_close(tensor, results[False][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.unit
def test_bf16_compute_keeps_float32_master_weights_and_close_log_probs(tiny_model_path: Path) -> None:
    exact = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, check_packing=False))
    mixed = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, dtype="bfloat16", check_packing=False))
    samples = _samples()
    reference = exact.compute_log_probs(samples, temperature=1.0).log_probs
    approximate = mixed.compute_log_probs(samples, temperature=1.0).log_probs
    assert approximate.dtype == torch.float32
    torch.testing.assert_close(approximate, reference, atol=0.05, rtol=0)
    result = mixed.train_step(samples, policy_loss(samples), temperature=1.0)
    assert not result.skipped
    assert all(tensor.dtype == torch.float32 for _, tensor in mixed.named_tensors())
