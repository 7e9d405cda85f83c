"""Checkpoint files of the torch trainer: atomic directories, safetensors weights and optimizer state.

A checkpoint directory holds `policy.safetensors` (float32 master weights under the model's in-memory names,
the exact tensors a resumed run continues from), `optimizer.safetensors` (every AdamW state tensor keyed
`<param name>::<state key>`, so it survives a change in parameter order) and `trainer_state.json` (version,
hyper-parameters, the caller's extra state). Nothing is pickled. Use `export_hf` for a transformers folder.

Atomicity: everything is written to a hidden sibling directory first and renamed into place, so a crash mid-way
leaves either the previous checkpoint or the new one, never a half-written directory under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "policy.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
_KEY_SEPARATOR = "::"
# Files `save_pretrained` writes itself, or weights in any format; everything else (tokenizer, chat template,
# remote code) is copied from the source model so an exported folder is complete.
_NOT_AUXILIARY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")
_NOT_AUXILIARY_NAMES = {"config.json", "generation_config.json"}


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a fresh staging directory that replaces `target` only if the block completes."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging = target.parent / f".{target.name}.staging-{token}"
    staging.mkdir()
    try:
        yield staging
        publish_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def publish_directory(staging: Path, target: Path) -> None:
    """Make a fully written `staging` directory become `target`: synced first, swapped by renames, so a crash
    leaves either the old or the new checkpoint under `target`, never a mix."""
    _fsync_tree(staging)
    if target.exists():
        retired = target.parent / f".{target.name}.retired-{uuid.uuid4().hex[:8]}"
        target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        staging.rename(target)


def check_json(extra_state: dict[str, Any]) -> None:
    """Fail before anything is written (and on every rank alike) if the caller's state cannot be stored."""
    try:
        json.dumps(extra_state)
    except (TypeError, ValueError) as error:
        raise ValueError(f"checkpoint extra_state must be JSON-serialisable: {error}") from error


def write_state(directory: Path, state: dict[str, Any]) -> None:
    (directory / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))


def read_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not a trainer checkpoint ({STATE_FILE} missing)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: corrupt trainer state: {error}") from error


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer, param_names: Sequence[str],
                   keep: bool = True) -> dict[str, Any] | None:
    """Write the optimizer's tensors to `path`; return the non-tensor part (hyper-parameters, scalars) for JSON.
    Not `keep`: nothing is written, and None (what `load_optimizer` reads as "start afresh") returned.

    `param_names[i]` names the optimizer's i-th parameter (groups flattened in order), as `state_dict` numbers them.
    """
    if not keep:
        return None
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        name = param_names[index]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}{_KEY_SEPARATOR}{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [param_names[i] for i in group["params"]]}
        for group in state_dict["param_groups"]
    ]
    save_file(tensors, str(path))
    return {"param_groups": groups, "scalars": scalars}


def load_optimizer(
    path: Path, optimizer: torch.optim.Optimizer, param_names: Sequence[str], meta: dict[str, Any] | None
) -> None:
    """Inverse of `save_optimizer`; refuses a checkpoint whose parameters differ from this model's. A checkpoint
    saved without its optimizer state (`meta` None) leaves the optimizer as it is: fresh, on a resumed run."""
    if meta is None:
        return
    saved_groups = meta["param_groups"]
    current = optimizer.state_dict()
    saved_names = [name for group in saved_groups for name in group["params"]]
    if saved_names != list(param_names):
        missing = sorted(set(param_names) - set(saved_names))
        unexpected = sorted(set(saved_names) - set(param_names))
        raise ValueError(
            f"{path}: optimizer state does not match this model (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, or a different grouping/order of parameters)"
        )
    index_of = {name: index for index, name in enumerate(param_names)}
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in load_file(str(path)).items():
        name, _, entry = key.rpartition(_KEY_SEPARATOR)
        state.setdefault(index_of[name], {})[entry] = tensor
    for name, entries in meta["scalars"].items():
        state.setdefault(index_of[name], {}).update(entries)
    groups = [
        {**saved, "params": group["params"]}
        for saved, group in zip(saved_groups, current["param_groups"], strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def copy_auxiliary_files(source: Path, destination: Path) -> None:
    """Copy tokenizer files and the like (anything not weights or config) from `source` to `destination`."""
    for path in source.iterdir():
        if not path.is_file() or path.name in _NOT_AUXILIARY_NAMES or path.name.endswith(_NOT_AUXILIARY_SUFFIXES):
            continue
        shutil.copy2(path, destination / path.name)


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename publishes them, so a power loss cannot expose empty files."""
    for path in directory.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
