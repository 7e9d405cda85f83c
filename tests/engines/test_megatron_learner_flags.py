"""slime's learner flags inside the Megatron trainer, under megatron-core's own parameter names (the names slime's
scripts write): freezing by name, the optimizer's state reset, the reference refreshed to the policy. One gloo
rank on this machine's device (megatron's CPU path here)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.support.training import seeded_batch, step_loss

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

SETTINGS = {"lr": 1e-2, "eps": 1.0, "grad_clip": None, "micro_batch_tokens": 60}


@pytest.fixture
def trainer(megatron_world: None, tiny_model_path: Path) -> Iterator[Any]:
    """Built as a run builds it, from slime's flags through the trainer factory (a KL loss loads the reference)."""
    from actors.config import add_config_flags, config_from_args
    from actors.learner.trainer_factory import build_trainer

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    config = config_from_args(parser.parse_args([
        "--hf-checkpoint", str(tiny_model_path), "--train-backend", "megatron", "--lr", "0.01",
        "--micro-batch-tokens", "60", "--use-kl-loss", "--kl-loss-coef", "0.1", "--reset-optimizer-states",
        "--ref-update-interval", "1", "--freeze-params-name-list", "word_embeddings", r"layers\.0\."]))
    trainer = build_trainer(config)
    try:
        yield trainer
    finally:
        trainer.close()


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
