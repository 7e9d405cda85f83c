"""Which Adam megatron built decides how the trainer repairs its state around a checkpoint load.

megatron-core picks transformer-engine's FusedAdam, then apex's, then torch's AdamW. Only torch's AdamW can run
here, so the two FusedAdam kinds are stand-ins that declare the real classes' module and name and keep their
step count the way the real ones do (one integer per param group), which is all the detection and the state
repairs look at. The megatron-built optimizer is the real one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engines.megatron import optimizer

pytest.importorskip("megatron.core")


def _fused_adam_class(module: str) -> type[torch.optim.Optimizer]:
    class FusedAdam(torch.optim.Optimizer):
        """Step count per param group, as TE's and apex's FusedAdam keep it."""

        def __init__(self, params: Any, lr: float = 1e-3) -> None:
            super().__init__(params, {"lr": lr})

        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1

    FusedAdam.__module__ = module
    return FusedAdam


class _Wrapped:
    """The shape of a megatron optimizer around a torch one (`.optimizer`), as the helpers see it."""

    def __init__(self, torch_optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = torch_optimizer


def _parameters() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]


@pytest.mark.unit
def test_torch_adamw_and_both_fused_adams_are_detected() -> None:
    assert optimizer.adam_kind(torch.optim.AdamW(_parameters())) == "torch"
    for module in ("transformer_engine.pytorch.optimizers.fused_adam", "apex.optimizers.fused_adam"):
        assert optimizer.adam_kind(_fused_adam_class(module)(_parameters())) == "fused"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), "torch.optim.sgd.SGD"),
        (lambda p: torch.optim.Adam(p), "torch.optim.adam.Adam"),  # L2 Adam: megatron's non-decoupled choice
        (lambda p: _fused_adam_class("some_other_package.optim")(p), "some_other_package.optim"),
    ],
)
def test_any_other_optimizer_is_refused_naming_its_class(make: Any, named: str) -> None:
    with pytest.raises(TypeError, match=named):
        optimizer.check_supported(_Wrapped(make(_parameters())))


@pytest.mark.unit
def test_torch_adamw_is_primed_with_a_step_and_its_shared_step_unshared() -> None:
    adamw = torch.optim.AdamW(_parameters())
    optimizer.prime(_Wrapped(adamw))
    assert all(set(state) == {"exp_avg", "exp_avg_sq", "step"} for state in adamw.state.values())
    shared = torch.tensor(5.0)
    for state in adamw.state.values():
        state["step"] = shared  # what megatron's distributed-optimizer load leaves behind
    optimizer.after_load(_Wrapped(adamw))
    steps = [state["step"] for state in adamw.state.values()]
    assert all(step is not shared and float(step) == 5.0 for step in steps)
    assert steps[0] is not steps[1]


@pytest.mark.unit
def test_fused_adam_state_is_left_to_megatron_and_a_float_group_step_becomes_an_int() -> None:
    fused = _fused_adam_class("transformer_engine.pytorch.optimizers.fused_adam")(_parameters())
    optimizer.prime(_Wrapped(fused))
    assert not fused.state  # megatron allocates fused Adam's moments itself; no per-parameter step exists
    fused.param_groups[0]["step"] = 7.0  # as written by a torch-AdamW checkpoint
    optimizer.after_load(_Wrapped(fused))
    assert fused.param_groups[0]["step"] == 7 and isinstance(fused.param_groups[0]["step"], int)
    with optimizer.step_tolerant_loading(_Wrapped(fused)):
        pass  # nothing to patch: no `_set_main_param_and_optimizer_states` repair for fused Adam


@pytest.mark.integration
def test_the_optimizer_megatron_builds_here_is_checked_at_start_up(tiny_model_path: Path) -> None:
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    trainer = MegatronTrainer(MegatronTrainerConfig(model_path=tiny_model_path))
    try:
        built = trainer._optimizer
        kinds = {type(t).__name__ for t in optimizer.torch_optimizers(built)}
        expected = "fused" if optimizer.megatron_uses_fused_adam() else "torch"
        assert optimizer.check_supported(built) == expected
        assert kinds == ({"FusedAdam"} if expected == "fused" else {"AdamW"})
        # megatron's distributed optimizer keys its step handling on its own flag: a disagreement is refused.
        with pytest.raises(TypeError, match="would lose the step count"):
            optimizer.check_supported(built, megatron_fused=expected == "torch")
    finally:
        trainer.close()
