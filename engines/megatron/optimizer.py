"""megatron's optimizer for the Megatron trainer: built (`build`), checked against megatron-core 0.16.1's Adam
choices, and its Adam state repaired around a distributed-optimizer checkpoint load as each choice needs.

Which Adam. `megatron.core.optimizer` imports transformer-engine's `FusedAdam`, else apex's `FusedAdam`, else
falls back to torch's `AdamW` (`USING_PYTORCH_OPTIMIZER`); `distrib_optimizer` repeats the same import chain
into its own flag (`HAVE_APEX_OR_TE`) and keys its save/load of Adam's step count on that flag, not on the class
it is given. The two kinds keep the step count in different places:

- "torch" (`torch.optim.AdamW`): a `step` tensor in every parameter's state. megatron's `state_dict()` asserts
  every parameter has one (a never-stepped optimizer has none), its load assigns ONE tensor to all parameters,
  and its fully-reshardable per-parameter copy expects `step` among the loaded tensors, which carry none.
  `prime`, `step_tolerant_loading` and `unshare_steps` repair those three.
- "fused" (TE / apex `FusedAdam`): one integer `step` per param group, saved and restored with the param groups;
  parameter state is only `exp_avg` / `exp_avg_sq`, which megatron allocates itself before a load. None of the
  three repairs applies; the one difference is that a checkpoint written by the torch kind stores a float step,
  which the fused kernels take as an int (`restore_group_steps`).

Anything else (SGD, torch's L2 `Adam`, a CPU-offloading `HybridDeviceOptimizer`, a kind disagreeing with
megatron's flag) is refused by `check_supported` when the trainer is built, naming the class: resuming with it
would silently reset or corrupt Adam's bias correction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from engines.megatron.config import MegatronTrainerConfig

AdamKind = Literal["torch", "fused"]
_FUSED_ADAM_PACKAGES = ("transformer_engine", "apex")


def build(config: MegatronTrainerConfig, module: nn.Module) -> Any:
    """megatron's Adam over `module` (distributed or not), with float32 master weights under bf16 as megatron's
    own `--bf16` training builds it; refused here, at start-up, if it is not an Adam we can checkpoint."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = config.dtype == "bfloat16"
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.eps,
        clip_grad=0.0,  # clipping is applied in MegatronTrainer._apply_update, after the finiteness check
        use_distributed_optimizer=config.use_distributed_optimizer,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
    )
    optimizer = get_megatron_optimizer(optimizer_config, [module])
    check_supported(optimizer)
    return optimizer


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside a `ChainedOptimizer` (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers megatron wraps; ranks with no parameters to optimise have none."""
    found = []
    for inner in inner_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is not None:
            found.append(torch_optimizer)
    return found


def adam_kind(torch_optimizer: torch.optim.Optimizer) -> AdamKind:
    """Where this Adam keeps its step count (module docstring); a clear error for any other optimizer."""
    cls = type(torch_optimizer)
    if cls is torch.optim.AdamW:
        return "torch"
    if cls.__name__ == "FusedAdam" and cls.__module__.split(".")[0] in _FUSED_ADAM_PACKAGES:
        return "fused"
    raise TypeError(
        f"the Megatron trainer supports the Adam optimizers megatron-core builds (torch.optim.AdamW, "
        f"transformer_engine or apex FusedAdam); megatron built {cls.__module__}.{cls.__qualname__}"
    )


def megatron_uses_fused_adam() -> bool:
    """megatron's distributed optimizer's own idea of the Adam in use (the flag its step handling reads)."""
    from megatron.core.optimizer import distrib_optimizer

    return bool(distrib_optimizer.HAVE_APEX_OR_TE)


def check_supported(optimizer: Any, *, megatron_fused: bool | None = None) -> AdamKind | None:
    """The Adam kind of a megatron optimizer (None where this rank optimises nothing); raise if unsupported.

    `megatron_fused` is megatron's flag (read from megatron when None): a distributed optimizer whose flag
    disagrees with the class it holds would save no step count (torch kind under a fused flag) or look for
    one that is not there (the reverse).
    """
    kinds = {adam_kind(torch_optimizer) for torch_optimizer in torch_optimizers(optimizer)}
    if len(kinds) > 1:
        raise TypeError(f"megatron built Adam optimizers of mixed kinds {sorted(kinds)}")
    if not kinds:
        return None
    kind = kinds.pop()
    if any(_is_distributed(inner) for inner in inner_optimizers(optimizer)):
        fused = megatron_uses_fused_adam() if megatron_fused is None else megatron_fused
        if fused != (kind == "fused"):
            raise TypeError(
                f"megatron's distributed optimizer handles Adam's step as {'fused' if fused else 'torch'} Adam "
                f"(HAVE_APEX_OR_TE={fused}) but holds a {kind} Adam; its checkpoints would lose the step count"
            )
    return kind


def prime(optimizer: Any) -> None:
    """Give every parameter of a never-stepped torch AdamW its state (zero moments, step 0) before a load.

    megatron's state initialiser creates the moments but not the `step` its distributed-optimizer
    `state_dict()` then asserts on; a trainer that has not stepped yet could not load. The values are
    overwritten by the load. Fused Adam needs nothing: its step lives in the param groups.
    """
    for torch_optimizer in torch_optimizers(optimizer):
        if adam_kind(torch_optimizer) != "torch":
            continue
        for group in torch_optimizer.param_groups:
            for parameter in group["params"]:
                state = torch_optimizer.state[parameter]
                if not state:
                    state["exp_avg"] = torch.zeros_like(parameter)
                    state["exp_avg_sq"] = torch.zeros_like(parameter)
                    state["step"] = torch.tensor(0.0)


@contextlib.contextmanager
def step_tolerant_loading(optimizer: Any) -> Iterator[None]:
    """Work around megatron-core 0.16 loading a fully-reshardable distributed-optimizer checkpoint into torch's
    AdamW: it first sets every parameter's `step` from the checkpoint's param groups, then copies each state
    entry from the per-parameter tensors, which carry no `step` (KeyError). We let the copy keep the `step` it
    just set. Fused Adam's state has no `step` entry, so its copy is left alone."""
    patched = []
    for inner in inner_optimizers(optimizer):
        original = getattr(inner, "_set_main_param_and_optimizer_states", None)
        torch_optimizer = getattr(inner, "optimizer", None)
        if original is None or torch_optimizer is None or adam_kind(torch_optimizer) != "torch":
            continue

        def tolerant(
            model_param: Any, tensors: dict[str, Tensor], inner: Any = inner, original: Any = original
        ) -> None:
            group_index, group_order = inner.model_param_group_index_map[model_param]
            main_param = inner.optimizer.param_groups[group_index]["params"][group_order]
            step = inner.optimizer.state[main_param].get("step")
            original(model_param, tensors if step is None or "step" in tensors else {**tensors, "step": step})

        inner._set_main_param_and_optimizer_states = tolerant
        patched.append(inner)
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states


def unshare_steps(optimizer: Any) -> None:
    """Give every parameter its own AdamW `step` tensor again after a distributed-optimizer load.

    megatron-core 0.16 (torch kind) restores `step` by assigning ONE tensor to every parameter's state. torch's
    AdamW increments each parameter's step in place, so the shared tensor advanced once per parameter on the
    first resumed step and later parameters got the wrong bias correction: the resumed step differed from the
    uninterrupted one by up to 3e-5 (found by the DP=2 resume parity test).
    """
    for torch_optimizer in torch_optimizers(optimizer):
        if adam_kind(torch_optimizer) != "torch":
            continue
        for state in torch_optimizer.state.values():
            step = state.get("step")
            if isinstance(step, Tensor):
                state["step"] = step.detach().clone()


def restore_group_steps(optimizer: Any) -> None:
    """Fused Adam passes its group's `step` to a CUDA kernel that takes an int; a checkpoint written by torch's
    AdamW stores it as a float (`Tensor.item()` of its step tensor)."""
    for torch_optimizer in torch_optimizers(optimizer):
        if adam_kind(torch_optimizer) != "fused":
            continue
        for group in torch_optimizer.param_groups:
            if isinstance(group.get("step"), float):
                group["step"] = int(group["step"])


def reset_state(optimizer: Any) -> None:
    """slime's --reset-optimizer-states: Adam's step count and moments back to zero, in place.

    Zeroed rather than dropped: megatron's distributed optimizer and its checkpoints expect every parameter's
    entries to exist once it has stepped (`prime`). Step 0 with zero moments is exactly a never-stepped Adam, so
    the next step's bias correction starts over. Both kinds: the torch kind's `step` tensors, the fused kind's
    per-group integer.
    """
    for torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            if "step" in group:
                group["step"] = 0
        for state in torch_optimizer.state.values():
            for key, value in state.items():
                if key == "step" and not isinstance(value, Tensor):
                    state[key] = 0
                elif key in ("step", "exp_avg", "exp_avg_sq"):
                    value.zero_()


def after_load(optimizer: Any) -> None:
    """Every post-load repair its Adam kind needs (see `unshare_steps`, `restore_group_steps`)."""
    unshare_steps(optimizer)
    restore_group_steps(optimizer)


def _is_distributed(inner: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(inner, DistributedOptimizer)
