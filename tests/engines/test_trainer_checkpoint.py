"""Checkpoints resume exactly (weights, optimizer moments, version), are written atomically, and export to HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.training import TorchTrainer, TorchTrainerConfig
from tests.support.training import loss_fn, random_samples


def _config(model_path: Path) -> TorchTrainerConfig:
    return TorchTrainerConfig(
        model_path=model_path,
        lr=1e-3,
        weight_decay=0.01,
        lr_schedule="cosine",
        warmup_steps=1,
        total_steps=10,
        micro_batch_tokens=48,
        check_packing=False,
    )


def _optimizer_tensors(trainer: TorchTrainer) -> dict[str, Tensor]:
    state = trainer._optimizer.state_dict()["state"]
    names = trainer._param_names
    return {f"{names[i]}/{key}": value for i, entries in state.items() for key, value in entries.items()}


@pytest.mark.unit
def test_resumed_step_equals_the_uninterrupted_step(tiny_model_path: Path, tmp_path: Path) -> None:
    uninterrupted = TorchTrainer(_config(tiny_model_path))
    uninterrupted.train_step(random_samples(0), loss_fn(random_samples(0)), temperature=1.0)
    uninterrupted.save_checkpoint(tmp_path / "step1", {"cursor": 17, "note": "after step 1"})
    uninterrupted.train_step(random_samples(1), loss_fn(random_samples(1)), temperature=1.0)

    resumed = TorchTrainer(_config(tiny_model_path))
    extra = resumed.load_checkpoint(tmp_path / "step1")
    assert extra == {"cursor": 17, "note": "after step 1"}
    assert resumed.version == 1
    resumed.train_step(random_samples(1), loss_fn(random_samples(1)), temperature=1.0)

    assert resumed.version == uninterrupted.version == 2
    expected = dict(uninterrupted.named_tensors())
    for name, tensor in resumed.named_tensors():
        assert torch.equal(tensor, expected[name]), name
    expected_moments = _optimizer_tensors(uninterrupted)
    resumed_moments = _optimizer_tensors(resumed)
    assert resumed_moments.keys() == expected_moments.keys()
    for key, tensor in resumed_moments.items():
        assert torch.equal(tensor, expected_moments[key]), key


@pytest.mark.unit
def test_saving_over_a_checkpoint_replaces_it_and_leaves_no_staging(tiny_model_path: Path, tmp_path: Path) -> None:
    trainer = TorchTrainer(_config(tiny_model_path))
    target = tmp_path / "latest"
    trainer.save_checkpoint(target, {"cursor": 1})
    trainer.train_step(random_samples(0), loss_fn(random_samples(0)), temperature=1.0)
    trainer.save_checkpoint(target, {"cursor": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert TorchTrainer(_config(tiny_model_path)).load_checkpoint(target) == {"cursor": 2}


@pytest.mark.unit
def test_failed_save_keeps_the_previous_checkpoint(tiny_model_path: Path, tmp_path: Path) -> None:
    trainer = TorchTrainer(_config(tiny_model_path))
    target = tmp_path / "latest"
    trainer.save_checkpoint(target, {"cursor": 1})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        trainer.save_checkpoint(target, {"cursor": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert TorchTrainer(_config(tiny_model_path)).load_checkpoint(target) == {"cursor": 1}


@pytest.mark.unit
def test_loading_a_folder_that_is_not_a_checkpoint_names_it(tiny_model_path: Path, tmp_path: Path) -> None:
    trainer = TorchTrainer(_config(tiny_model_path))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: not a trainer checkpoint"):
        trainer.load_checkpoint(tmp_path)


@pytest.mark.unit
def test_exported_folder_loads_in_transformers_with_the_trained_weights(tiny_model_path: Path, tmp_path: Path) -> None:
    trainer = TorchTrainer(_config(tiny_model_path))
    trainer.train_step(random_samples(0), loss_fn(random_samples(0)), temperature=1.0)
    trainer.export_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    loaded = dict(model.named_parameters())
    for name, tensor in trainer.named_tensors():
        assert torch.equal(loaded[name], tensor), name
    exported, original = (AutoTokenizer.from_pretrained(path) for path in (tmp_path / "hf", tiny_model_path))
    messages = [{"role": "user", "content": "2+2?"}]
    assert exported.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(
        messages, tokenize=False
    )
    assert exported.encode("hi there") == original.encode("hi there")


@pytest.mark.unit
def test_a_checkpoint_without_the_optimizer_resumes_the_weights_with_a_fresh_optimizer(tiny_model_path: Path,
                                                                                         tmp_path: Path) -> None:
    """slime's --no-save-optim: no optimizer file; the resumed trainer has the saved weights and version, no
    moments, and it trains on from there (its optimizer made afresh by the next step)."""
    config = _config(tiny_model_path).model_copy(update={"save_optimizer": False})
    trainer = TorchTrainer(config)
    trainer.train_step(random_samples(0), loss_fn(random_samples(0)), temperature=1.0)
    trainer.save_checkpoint(tmp_path / "step1", {"cursor": 3})
    assert not (tmp_path / "step1" / "optimizer.safetensors").exists()
    saved = {name: tensor.clone() for name, tensor in trainer.named_tensors()}

    resumed = TorchTrainer(config)
    assert resumed.load_checkpoint(tmp_path / "step1") == {"cursor": 3} and resumed.version == 1
    assert all(torch.equal(tensor, saved[name]) for name, tensor in resumed.named_tensors())
    assert _optimizer_tensors(resumed) == {}
    resumed.train_step(random_samples(1), loss_fn(random_samples(1)), temperature=1.0)
    assert resumed.version == 2
    assert {key.rsplit("/", 1)[1] for key in _optimizer_tensors(resumed)} >= {"exp_avg", "exp_avg_sq"}
