"""LoRA on the torch trainer: only the adapter trains, travels and is checkpointed; exports load as HF and PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM

from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.lora import LoraSettings
from engines.training.micro_batches import forward_packed, pack_inputs
from tests.support.training import loss_fn, random_samples

pytestmark = pytest.mark.unit
ADAPTER = LoraSettings(rank=4, alpha=8.0)


def _config(model_path: Path, adapter: LoraSettings | None = ADAPTER, **overrides: object) -> TorchTrainerConfig:
    settings = {"model_path": model_path, "lr": 1e-2, "micro_batch_tokens": 48, "check_packing": False,
                "lora": adapter, **overrides}
    return TorchTrainerConfig(**settings)


def _trained(model_path: Path, steps: int = 2, **overrides: object) -> TorchTrainer:
    trainer = TorchTrainer(_config(model_path, **overrides))
    for seed in range(steps):
        trainer.train_step(random_samples(seed), loss_fn(random_samples(seed)), temperature=1.0)
    return trainer


def _logits(model: torch.nn.Module, samples: list[TrainSample]) -> Tensor:
    with torch.no_grad():
        return forward_packed(model.eval(), pack_inputs(samples))


def test_only_the_adapter_trains_and_only_it_is_sent(tiny_model_path: Path) -> None:
    trainer = _trained(tiny_model_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    sent = dict(trainer.named_tensors())

    assert sent and all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in sent)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in sent
    assert "model.layers.1.mlp.down_proj.lora_B.weight" in sent  # all-linear reaches the MLP too
    assert not any("lm_head" in name for name in sent)
    assert all(bool(tensor.abs().sum()) for name, tensor in sent.items() if "lora_B" in name)  # B moved off zero
    adapter_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert adapter_bytes * 5 < full_bytes
    for name, parameter in trainer._model.named_parameters():  # the base is frozen and unchanged
        if not parameter.requires_grad:
            plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(parameter, base[plain]), name


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_model_path: Path, tmp_path: Path) -> None:
    uninterrupted = _trained(tiny_model_path, steps=1)
    uninterrupted.save_checkpoint(tmp_path / "step1", {"cursor": 3})
    uninterrupted.train_step(random_samples(1), loss_fn(random_samples(1)), temperature=1.0)
    stored = load_file(str(tmp_path / "step1" / "policy.safetensors"))
    assert stored and all(".lora_" in name for name in stored)  # no copy of the base weights

    resumed = TorchTrainer(_config(tiny_model_path))
    assert resumed.load_checkpoint(tmp_path / "step1") == {"cursor": 3}
    resumed.train_step(random_samples(1), loss_fn(random_samples(1)), temperature=1.0)
    assert resumed.version == uninterrupted.version == 2
    expected = dict(uninterrupted.named_tensors())
    for name, tensor in resumed.named_tensors():
        assert torch.equal(tensor, expected[name]), name


def test_a_checkpoint_of_another_shape_is_refused_by_what_differs(tiny_model_path: Path, tmp_path: Path) -> None:
    TorchTrainer(_config(tiny_model_path)).save_checkpoint(tmp_path / "lora", {})
    TorchTrainer(_config(tiny_model_path, adapter=None)).save_checkpoint(tmp_path / "full", {})
    with pytest.raises(ValueError, match=r"adapter settings .*'alpha': 8\.0.* differ .*'alpha': 16\.0"):
        TorchTrainer(_config(tiny_model_path, LoraSettings(rank=4, alpha=16.0))).load_checkpoint(tmp_path / "lora")
    with pytest.raises(ValueError, match="a full-weight checkpoint; this run trains a LoRA adapter"):
        TorchTrainer(_config(tiny_model_path)).load_checkpoint(tmp_path / "full")


def test_the_reference_is_the_base_model_with_the_adapter_off(tiny_model_path: Path) -> None:
    trainer = _trained(tiny_model_path, ref_model_path=tiny_model_path)
    assert trainer._ref is None  # no second copy of the weights
    assert not trainer.prepares_beside_training
    plain = TorchTrainer(_config(tiny_model_path, adapter=None))
    samples = random_samples(5)
    reference = trainer.compute_log_probs(samples, temperature=1.0, model="ref").log_probs
    policy = trainer.compute_log_probs(samples, temperature=1.0).log_probs
    base = plain.compute_log_probs(samples, temperature=1.0).log_probs
    torch.testing.assert_close(reference, base)
    assert (policy - base).abs().max() > 1e-3  # and the adapter is back on afterwards


def test_the_export_is_the_merged_policy_and_its_adapter(tiny_model_path: Path, tmp_path: Path) -> None:
    trainer = _trained(tiny_model_path)
    trainer.export_hf(tmp_path / "final")
    samples = random_samples(7)
    expected = _logits(trainer._model, samples)

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    torch.testing.assert_close(_logits(merged, samples), expected, atol=1e-4, rtol=1e-4)
    assert (tmp_path / "final" / "tokenizer.json").is_file()

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, tmp_path / "final" / "adapter")
    torch.testing.assert_close(_logits(with_adapter, samples), expected)
    # Exporting left the training weights as they were.
    torch.testing.assert_close(_logits(trainer._model, samples), expected, atol=0, rtol=0)


def test_target_modules_that_match_nothing_name_the_flag(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match="--target-modules nonexistent_proj"):
        TorchTrainer(_config(tiny_model_path, LoraSettings(rank=4, alpha=8.0, target_modules=("nonexistent_proj",))))
    with pytest.raises(ValueError, match="all-linear already names every linear layer"):
        LoraSettings(rank=4, alpha=8.0, target_modules=("all-linear", "q_proj"))
