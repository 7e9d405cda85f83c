"""slime's learner flags inside the Megatron trainer, under megatron-core's own parameter names (the names slime's
scripts write): freezing by name, the optimizer's state reset, the reference refreshed to the policy, and on-policy
distillation with the teacher held by the trainer (`--opd-type megatron`). One gloo rank on this machine's device
(megatron's CPU path here)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.support.training import seeded_batch, step_loss
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

SETTINGS = {"lr": 1e-2, "eps": 1.0, "grad_clip": None, "micro_batch_tokens": 60}


@pytest.fixture
def trainer(megatron_world: None, tiny_model_path: Path) -> Iterator[Any]:
    """Built as a run builds it, from slime's flags through the trainer factory (a KL loss loads the reference)."""
    from actors.learner.trainer_factory import build_trainer

    trainer = build_trainer(_config([
        "--hf-checkpoint", str(tiny_model_path), "--train-backend", "megatron", "--lr", "0.01",
        "--micro-batch-tokens", "60", "--use-kl-loss", "--kl-loss-coef", "0.1", "--reset-optimizer-states",
        "--ref-update-interval", "1", "--freeze-params-name-list", "word_embeddings", r"layers\.0\."]))
    try:
        yield trainer
    finally:
        trainer.close()


def _config(flags: list[str]) -> Any:
    from actors.config import add_config_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(flags))


def _parameters(trainer: Any) -> dict[str, Tensor]:
    return {name: parameter.detach().clone() for name, parameter in trainer._stage.named_parameters()}


def _step(trainer: Any) -> None:
    batch = seeded_batch()
    assert not trainer.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True).skipped


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_megatron_freezes_by_its_names_resets_adam_and_refreshes_its_reference(trainer: Any) -> None:
    from engines.megatron import optimizer

    batch = seeded_batch()

    def scores(model: str) -> Tensor:
        return trainer.compute_log_probs(batch, temperature=1.0, model=model).log_probs

    initial = scores("ref")
    before = _parameters(trainer)
    assert "embedding.word_embeddings.weight" in before and "decoder.layers.0.mlp.linear_fc1.weight" in before
    _step(trainer)
    after = _parameters(trainer)
    frozen = {name for name in before if "word_embeddings" in name or "layers.0." in name}
    assert {name for name in before if not torch.equal(before[name], after[name])} == set(before) - frozen

    adams = optimizer.torch_optimizers(trainer._optimizer)
    states = [state for adam in adams for state in adam.state.values()]
    assert states and all(float(state["exp_avg_sq"].abs().sum()) > 0 for state in states)
    trainer.reset_optimizer_state()
    assert all(float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
               for state in states)
    _step(trainer)  # Adam starts over: its step count is 1 again, not 2
    assert all(float(state["step"]) == 1 for state in states)

    assert torch.equal(scores("ref"), initial)
    trainer.refresh_reference()
    torch.testing.assert_close(scores("ref"), scores("policy"), atol=0, rtol=0)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_megatron_pattern_that_matches_nothing_is_refused_with_megatron_names(
        megatron_world: None, tiny_model_path: Path) -> None:
    """Checked over every rank (a pipeline stage may hold none of a pattern's layers); the world is the fixture's,
    which tears it down after the refused construction."""
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    with pytest.raises(ValueError, match=r"--only-train-params-name-list lm_head: 'lm_head' matches no trainable "
                                         r"parameter name .* embedding\.word_embeddings\.weight"):
        MegatronTrainer(MegatronTrainerConfig(model_path=tiny_model_path, only_train_params_name_list=("lm_head",),
                                              **SETTINGS))


# ------------------------------------------------------------------------------------- the learner's teacher
@pytest.fixture(scope="module")
def teacher_path(tiny_model_cache: Path) -> Path:
    """A teacher of the student's tokenizer and its own, larger shape (three layers, wider), other weights."""
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(hidden_size=96, intermediate_size=224,
                                                             num_hidden_layers=3, num_attention_heads=6, seed=11))


def _distillation_run(student: Path, teacher: Path) -> Any:
    """slime's run-qwen3-8B-opd-megatron.sh flags: the teacher held by the (Megatron) trainer, no task reward."""
    return _config(["--hf-checkpoint", str(student), "--train-backend", "megatron", "--lr", "0.01",
                    "--micro-batch-tokens", "60", "--use-opd", "--opd-type", "megatron", "--opd-kl-coef", "1.0",
                    "--opd-teacher-load", str(teacher), "--rm-type", "zero"])


def _samples(batch: list[Any], engine_log_probs: Tensor) -> list[Any]:
    """`batch` as the rollout workers' samples, unrewarded-zero, with the engine's log-probs of their tokens."""
    import numpy as np

    from bus.schema import Sample

    samples, start = [], 0
    for index, sample in enumerate(batch):
        length = sample.response_length
        samples.append(Sample(
            sample_id=f"g{index // 2}/{index % 2}", group_id=f"g{index // 2}", index=index % 2, prompt="",
            prompt_tokens=len(sample.tokens) - length, tokens=sample.tokens.numpy().astype(np.int32),
            response_length=length, reward=0.0, status="completed",
            rollout_log_probs=engine_log_probs[start : start + length].numpy(),
            token_versions=np.zeros(length, dtype=np.int32)))
        start += length
    return samples


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_megatron_trainer_holds_slimes_megatron_teacher_and_distils_from_it(
        megatron_world: None, tiny_model_path: Path, teacher_path: Path) -> None:
    """The teacher's log-probs equal the torch trainer's teacher's on the same folder and tokens, and a learner step
    with `--use-opd` trains on them: its reverse-KL metrics are the student's log-ratio to that teacher."""
    from actors.learner.step import TrainingStep
    from actors.learner.trainer_factory import build_trainer
    from engines.training import TorchTrainer, TorchTrainerConfig
    from engines.training.base import teacher_role

    config = _distillation_run(tiny_model_path, teacher_path)
    trainer = build_trainer(config)
    torch_trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, micro_batch_tokens=60,
                                                    teacher_model_paths={"teacher": teacher_path}))
    batch = seeded_batch()
    try:
        role = teacher_role("teacher")
        teacher = trainer.compute_log_probs(batch, temperature=1.0, model=role).log_probs
        expected = torch_trainer.compute_log_probs(batch, temperature=1.0, model=role).log_probs
        torch.testing.assert_close(teacher, expected, atol=1e-5, rtol=1e-5)
        student = torch_trainer.compute_log_probs(batch, temperature=1.0).log_probs
        assert (student - teacher).abs().mean() > 0.1  # the teacher's own network, not the policy's

        before = _parameters(trainer)
        samples = _samples(batch, student)
        report = TrainingStep(trainer, config).train(samples, staleness=[0] * len(samples))
        assert not report.result.skipped and trainer.version == 1
        tokens = sum(sample.response_length for sample in batch)
        assert report.metrics["opd/tokens/teacher"] == tokens
        # every response token trains (the samples carry no loss mask); the student is pi_old, the policy as it was
        assert report.metrics["opd/reverse_kl/teacher"] == pytest.approx(float((student - teacher).mean()), abs=1e-4)
        after = _parameters(trainer)
        assert any(not torch.equal(before[name], after[name]) for name in before)
    finally:
        trainer.close()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_teacher_the_megatron_trainer_cannot_build_is_named_with_its_folder(
        megatron_world: None, tiny_model_path: Path, tmp_path: Path) -> None:
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    with pytest.raises(ValueError, match=rf"distillation teacher 'math' \({tmp_path}\) cannot be held by the Megatron "
                                         r"trainer at TP=1 x PP=1: .*config\.json"):
        MegatronTrainer(MegatronTrainerConfig(model_path=tiny_model_path, teacher_model_paths={"math": tmp_path},
                                              **SETTINGS))
