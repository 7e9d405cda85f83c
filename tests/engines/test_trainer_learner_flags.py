"""slime's learner flags inside the torch trainer: parameters frozen by name, the optimizer's state reset, and the
reference model refreshed to the policy (`--only-train-params-name-list`, `--freeze-params-name-list`,
`--reset-optimizer-states`, `--use-stateless-adam`, `--ref-update-interval`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from engines.training import TorchTrainer, TorchTrainerConfig
from tests.support.training import seeded_batch, step_loss

# eps=1 keeps AdamW's update proportional to its moments, so a state carried over shows in the weights.
OPTIMIZER = {"lr": 1e-2, "eps": 1.0, "grad_clip": None, "check_packing": False}


def _weights(trainer: TorchTrainer) -> dict[str, Tensor]:
    return {name: tensor.detach().clone() for name, tensor in trainer.named_tensors()}


def _step(trainer: TorchTrainer, batch: list | None = None) -> None:
    batch = batch if batch is not None else seeded_batch()
    result = trainer.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True)
    assert not result.skipped, result.skip_reason


def _changed(before: dict[str, Tensor], after: dict[str, Tensor]) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


@pytest.mark.integration
def test_only_the_listed_parameters_train_and_only_they_get_optimizer_state(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, **OPTIMIZER,
                                              only_train_params_name_list=(r"layers\.1\.mlp", "lm_head")))
    before = _weights(trainer)
    _step(trainer)
    changed = _changed(before, _weights(trainer))
    assert changed == {name for name in before if "layers.1.mlp" in name or name == "lm_head.weight"}
    trained = {name for name, parameter in trainer._model.named_parameters() if parameter.requires_grad}
    assert trained == changed
    assert len(trainer._optimizer.state) == len(trained)  # no moments kept for a frozen parameter


@pytest.mark.integration
def test_frozen_parameters_keep_their_values_and_the_rest_trains(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, **OPTIMIZER,
                                              freeze_params_name_list=("embed", r"layers\.0\.")))
    before = _weights(trainer)
    _step(trainer)
    frozen = {name for name in before if "embed" in name or "layers.0." in name}
    assert _changed(before, _weights(trainer)) == set(before) - frozen
    assert all(parameter.grad is None for name, parameter in trainer._model.named_parameters() if name in frozen)


@pytest.mark.integration
def test_a_pattern_that_matches_nothing_names_its_flag_and_real_names(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--freeze-params-name-list embed output_layer: 'output_layer' matches no "
                                         r"trainable parameter name .* model\.embed_tokens\.weight"):
        TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, freeze_params_name_list=("embed", "output_layer")))
    with pytest.raises(ValueError, match=r"--freeze-params-name-list \.: freezes every trainable parameter"):
        TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, freeze_params_name_list=(".",)))


@pytest.mark.unit
def test_both_lists_or_a_broken_pattern_are_refused_before_any_model_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--only-train-params-name-list and --freeze-params-name-list were both"):
        TorchTrainerConfig(model_path=tmp_path, only_train_params_name_list=("a",), freeze_params_name_list=("b",))
    with pytest.raises(ValueError, match=r"--only-train-params-name-list 'layers\.\(': not a regular expression"):
        TorchTrainerConfig(model_path=tmp_path, only_train_params_name_list=("layers.(",))


@pytest.mark.integration
def test_after_a_reset_the_next_step_is_a_fresh_optimizers_first_step(tiny_model_path: Path, tmp_path: Path) -> None:
    """Step on batch A, reset, step on batch B == a new trainer started from the weights after A, stepping on B;
    without the reset, A's moments and step count make B's update differ."""
    first, second = seeded_batch()[:4], seeded_batch()[4:]
    kept, reset = (TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, **OPTIMIZER)) for _ in range(2))
    for trainer in (kept, reset):
        _step(trainer, first)
    reset.export_hf(tmp_path / "after_first")
    fresh = TorchTrainer(TorchTrainerConfig(model_path=tmp_path / "after_first", **OPTIMIZER))
    reset.reset_optimizer_state()
    assert not reset._optimizer.state
    for trainer in (kept, reset, fresh):
        _step(trainer, second)
    expected = _weights(fresh)
    for name, tensor in _weights(reset).items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
    assert any(not torch.allclose(tensor, expected[name], atol=1e-4) for name, tensor in _weights(kept).items())


@pytest.mark.unit
def test_stateless_adam_is_a_fresh_adamw_at_every_step() -> None:
    from engines.training.optimizers import StatelessAdamW

    torch.manual_seed(0)
    start = torch.randn(16, dtype=torch.float64)
    grads = [torch.randn(16, dtype=torch.float64) for _ in range(3)]
    settings = {"lr": 0.03, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.1}
    ours = start.clone().requires_grad_(True)
    optimizer = StatelessAdamW([ours], **settings)
    expected = start.clone()
    for grad in grads:
        ours.grad = grad.clone()
        optimizer.step()
        fresh = expected.clone().requires_grad_(True)
        fresh.grad = grad.clone()
        torch.optim.AdamW([fresh], **settings).step()
        expected = fresh.detach()
    torch.testing.assert_close(ours.detach(), expected)
    assert optimizer.state_dict()["state"] == {}


@pytest.mark.integration
def test_stateless_adam_steps_as_a_reset_adam_does_and_keeps_no_state(tiny_model_path: Path) -> None:
    """--use-stateless-adam: every step equals --reset-optimizer-states' reset before it (a fresh AdamW's first
    step), with no moments held; a plain AdamW's second step differs."""
    first, second = seeded_batch()[:4], seeded_batch()[4:]
    stateless = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, stateless_adam=True, weight_decay=0.1,
                                                **OPTIMIZER))
    reset, kept = (TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, weight_decay=0.1, **OPTIMIZER))
                   for _ in range(2))
    for batch in (first, second):
        reset.reset_optimizer_state()
        for trainer in (stateless, reset, kept):
            _step(trainer, batch)
    assert not stateless._optimizer.state and reset._optimizer.state
    expected = _weights(reset)
    for name, tensor in _weights(stateless).items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
    assert any(not torch.allclose(tensor, expected[name], atol=1e-4) for name, tensor in _weights(kept).items())


@pytest.mark.integration
def test_a_refreshed_reference_scores_as_the_policy_does(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, ref_model_path=tiny_model_path,
                                              **OPTIMIZER))
    batch = seeded_batch()

    def scores(model: str) -> Tensor:
        return trainer.compute_log_probs(batch, temperature=1.0, model=model).log_probs

    initial = scores("ref")
    _step(trainer)
    assert torch.equal(scores("ref"), initial)  # frozen until refreshed
    assert not torch.allclose(scores("policy"), initial, atol=1e-4)
    trainer.refresh_reference()
    torch.testing.assert_close(scores("ref"), scores("policy"), atol=0, rtol=0)
    _step(trainer)  # the copy is the reference's own: training the policy on does not move it
    assert not torch.allclose(scores("ref"), scores("policy"), atol=1e-4)
