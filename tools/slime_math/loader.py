"""Load slime's pure RL math from a slime source tree, without Megatron, Ray or a GPU (for compare.py).

``slime/utils/ppo_utils.py`` and the example ``mis.py`` are executed as modules (with ``torch.compile`` turned
into a no-op so nothing is compiled). From files whose imports pull in Megatron or Ray (``loss.py``,
``cp_utils.py``, ``distributed_utils.py``, ``ray/rollout.py``) only the named functions are lifted out with
:mod:`ast` and run in a namespace where Megatron's ``mpu`` and ``torch.distributed`` are single-process
stand-ins. Nothing of slime is copied into this repository: the tree is read at run time.
"""

from __future__ import annotations

import argparse
import ast
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_slime"]


class _SingleRankMpu:
    """Megatron's ``mpu`` for one process: no context, pipeline or data parallelism."""

    @staticmethod
    def get_context_parallel_world_size() -> int:
        return 1

    @staticmethod
    def get_context_parallel_rank() -> int:
        return 0

    @staticmethod
    def is_pipeline_last_stage() -> bool:
        return True

    @staticmethod
    def get_data_parallel_group(with_context_parallel: bool = False) -> None:
        return None

    @staticmethod
    def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
        return 1

    @staticmethod
    def get_context_parallel_group() -> None:
        return None


class _SingleProcessDist:
    """``torch.distributed`` for one process: all-reduce is the identity."""

    ReduceOp = torch.distributed.ReduceOp

    @staticmethod
    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        return None

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def is_initialized() -> bool:
        return False


@contextmanager
def _no_compile() -> Iterator[None]:
    """``@torch.compile(dynamic=True)`` becomes the identity while slime's module is executed."""
    original = torch.compile
    torch.compile = lambda *args, **kwargs: lambda fn: fn  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def _install_megatron_stub() -> None:
    """Functions in ppo_utils import ``mpu`` lazily (``from megatron.core import mpu``); give them the stand-in."""
    if "megatron.core" in sys.modules:
        return
    megatron = types.ModuleType("megatron")
    core = types.ModuleType("megatron.core")
    core.mpu = _SingleRankMpu  # type: ignore[attr-defined]
    megatron.core = core  # type: ignore[attr-defined]
    sys.modules["megatron"] = megatron
    sys.modules["megatron.core"] = core


def _load_module(path: Path, name: str) -> types.ModuleType:
    if not path.is_file():
        raise SystemExit(f"--slime: {path} not found; is this a slime source tree?")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    with _no_compile():
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _lift(path: Path, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute only the named top-level functions (or a class's method, ``Class.method``) of ``path``."""
    if not path.is_file():
        raise SystemExit(f"--slime: {path} not found; is this a slime source tree?")
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted: list[ast.stmt] = []
    for name in names:
        owner, _, method = name.rpartition(".")
        scope = tree.body
        if owner:
            classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
            if not classes:
                raise SystemExit(f"--slime: class {owner} not found in {path}")
            scope = classes[0].body
        found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == (method or name)]
        if not found:
            raise SystemExit(f"--slime: function {name} not found in {path}")
        wanted.append(found[0])
    with _no_compile():
        exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def load_slime(root: Path) -> types.SimpleNamespace:
    """slime's pure math, loaded from the tree at ``root``."""
    _install_megatron_stub()
    ppo = _load_module(root / "slime/utils/ppo_utils.py", "slime_ppo_utils")
    mis_module = _load_module(root / "examples/train_infer_mismatch_helper/mis.py", "slime_mis")
    base: dict[str, Any] = {
        "torch": torch,
        "F": torch.nn.functional,
        "dist": _SingleProcessDist,
        "mpu": _SingleRankMpu,
        "Any": Any,
        "Callable": Callable,
    }
    whiten_ns = _lift(root / "slime/utils/distributed_utils.py", ["distributed_masked_whiten"], dict(base))
    cp_ns = _lift(root / "slime/backends/megatron_utils/cp_utils.py", ["get_sum_of_sample_mean"], dict(base))
    loss_ns = dict(base)
    loss_ns.update({k: v for k, v in vars(ppo).items() if not k.startswith("__")})
    loss_ns.update(
        distributed_masked_whiten=whiten_ns["distributed_masked_whiten"],
        get_sum_of_sample_mean=cp_ns["get_sum_of_sample_mean"],
        checkpoint=None,
        Namespace=argparse.Namespace,
        RolloutBatch=dict,
        load_function=lambda path: path,  # our rows pass the function itself as the "path"
    )
    _lift(
        root / "slime/backends/megatron_utils/loss.py",
        ["apply_opd_kl_to_advantages", "compute_advantages_and_returns", "vanilla_tis_function", "icepop_function",
         "loss_function", "value_loss_function"],
        loss_ns,
    )
    rollout_ns = _lift(root / "slime/ray/rollout.py", ["RolloutManager._post_process_rewards"], dict(base))
    return types.SimpleNamespace(
        ppo=ppo,
        mis=mis_module,
        whiten=whiten_ns["distributed_masked_whiten"],
        sum_of_sample_mean=cp_ns["get_sum_of_sample_mean"],
        compute_advantages_and_returns=loss_ns["compute_advantages_and_returns"],
        vanilla_tis=loss_ns["vanilla_tis_function"],
        icepop=loss_ns["icepop_function"],
        loss_function=loss_ns["loss_function"],
        value_loss_function=loss_ns["value_loss_function"],
        loss_namespace=loss_ns,
        post_process_rewards=rollout_ns["_post_process_rewards"],
    )
