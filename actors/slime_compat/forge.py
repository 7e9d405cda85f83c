"""slime's rollout dumps replayed as the learner's batches: ``--load-forge-rollout-data`` (slime's forge replay).

slime writes each rollout's samples with ``torch.save({"rollout_id": id, "samples": [sample.to_dict(), ...]})``
(``--save-debug-rollout-data``, ``--dump-details``), and ``slime.rollout.forge_load.generate_rollout`` feeds such a
dump back as the rollout's output while the engines stay up and take every weight push (slime's memory tests).
Here that is the learner's replay of recorded batches (``actors.learner.modes``): the dump of batch N is read in
place of the buffer's, and a run that starts engines still pushes its weights to them (no ``--debug-train-only``).

The path is slime's: a file reused for every batch, or a ``{rollout_id}`` template read per batch (``rollout_id``
is the 0-based batch id) that falls back to its ``0`` file when a batch has none, as forge_load does. Each file is
read with ``torch.load(weights_only=True)``: only tensors and plain values, never code. A dump of text samples is
that (``to_dict`` leaves lists, numbers, strings and dicts); one holding other objects (numpy arrays, images) is
refused by name rather than unpickled. ``remove_sample`` is honoured (its loss mask is zeroed, as slime trains
it), a dict reward is read at ``--reward-key`` (or its ``reward``), and a sample's tokens are given the learner's
version: a replay has no engine versions, so every sample trains as fresh (staleness 0).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.config import RunConfig
from actors.slime_compat.sample import Sample, to_wire
from bus.schema import Batch, PromptGroup

__all__ = ["FLAG", "dump_batch_reader", "dump_path", "read_dump"]

FLAG = "--load-forge-rollout-data"
TEMPLATE = "{rollout_id}"
_FIELDS = {f.name for f in dataclasses.fields(Sample)}


def dump_batch_reader(config: RunConfig) -> Callable[[int, int], Batch] | None:
    """The reader of batch N (at learner version v) from slime's dumps (a file, or a template), or None when the
    recording is a folder of our own batches (`--load-debug-rollout-data DIR`)."""
    where = config.learner.load_debug_rollout_data
    if where is None or not (TEMPLATE in where or Path(where).is_file()):
        return None
    if TEMPLATE in where:
        _check_template(where)
    n_samples = config.rollout.n_samples_per_prompt
    reward_key = config.reward.reward_key

    def read(batch_id: int, learner_version: int) -> Batch:
        path = dump_path(where, batch_id - 1)
        return read_dump(path, batch_id=batch_id, learner_version=learner_version, n_samples=n_samples,
                         reward_key=reward_key)

    return read


def dump_path(where: str, rollout_id: int) -> Path:
    """slime's file for `rollout_id`: the literal file, or the template's, falling back to its ``0`` file."""
    if TEMPLATE not in where:
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"{FLAG} {where}: no such file")
        return path
    path = Path(where.format(rollout_id=rollout_id))
    if path.is_file():
        return path
    fallback = Path(where.format(rollout_id=0))
    if fallback.is_file():
        return fallback
    raise FileNotFoundError(f"{FLAG} {where}: neither {path} (batch {rollout_id + 1}) nor {fallback} exists")


def read_dump(path: Path, *, batch_id: int, learner_version: int, n_samples: int,
              reward_key: str | None = None) -> Batch:
    """One slime dump as our batch: its samples in whole groups, each group's samples in their order."""
    records = _records(path)
    samples = [_sample(record, path, position, reward_key) for position, record in enumerate(records)]
    groups = _groups(samples, path, n_samples)
    wire = []
    for number, (data_index, members) in enumerate(groups):
        first = members[0]
        group = PromptGroup(group_id=f"forge-{batch_id}-{number}", prompt=first.prompt, label=first.label,
                            n_samples=len(members), data_index=data_index)
        wire += [to_wire(sample, group, index, start_version=learner_version) for index, sample in enumerate(members)]
    return Batch(batch_id=batch_id, samples=wire, staleness=[0] * len(wire), learner_version=learner_version)


def _records(path: Path) -> list[dict[str, Any]]:
    import torch

    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise ValueError(f"{FLAG} {path}: not a dump of plain values (torch.load weights_only=True refused it: "
                         f"{str(error).splitlines()[0]}); only tensors, lists, numbers, strings and dicts are read, "
                         "never pickled objects") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("samples"), list):
        found = f"a dict of {sorted(map(str, blob))}" if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"{FLAG} {path}: expected slime's dump, a dict with a 'samples' list (found {found})")
    if not blob["samples"]:
        raise ValueError(f"{FLAG} {path}: the dump holds no samples")
    return blob["samples"]


def _sample(record: Any, path: Path, position: int, reward_key: str | None) -> Sample:
    """slime's ``Sample.from_dict`` on our slime-shaped class: its fields taken, the rest (speculative-decoding and
    prefix-cache counters, fields of newer slimes) left out; tensors become lists."""
    where = f"{FLAG} {path}: sample {position}"
    if not isinstance(record, dict):
        raise ValueError(f"{where} is {type(record).__name__}, expected a dict (slime's Sample.to_dict)")
    values = {key: _plain(value) for key, value in record.items() if key in _FIELDS}
    try:
        values["status"] = Sample.Status(values.get("status", "completed"))
    except ValueError:
        raise ValueError(f"{where}: unknown status {values.get('status')!r}") from None
    sample = Sample(**values)
    reward = sample.reward
    if isinstance(reward, dict):
        key = reward_key or "reward"
        if key not in reward:
            raise ValueError(f"{where}: its reward is a dict without {key!r} (--reward-key)")
        reward = reward[key]
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        raise ValueError(f"{where}: reward {reward!r} is not a number (a dump of scored samples is needed)")
    sample.reward = float(reward)
    return sample


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str | bytes) else value


def _groups(samples: list[Sample], path: Path, n_samples: int) -> list[tuple[int, list[Sample]]]:
    """By slime's ``group_index`` where every sample has one (in order of first appearance), else consecutive runs
    of ``--n-samples-per-prompt``, as slime lays a rollout's groups out."""
    if all(sample.group_index is not None for sample in samples):
        grouped: dict[int, list[Sample]] = {}
        for sample in samples:
            grouped.setdefault(int(sample.group_index), []).append(sample)  # type: ignore[arg-type]
        return list(grouped.items())
    if len(samples) % n_samples:
        raise ValueError(f"{FLAG} {path}: {len(samples)} samples without group_index do not make whole groups of "
                         f"--n-samples-per-prompt {n_samples}")
    return [(start // n_samples, samples[start:start + n_samples]) for start in range(0, len(samples), n_samples)]


def _check_template(where: str) -> None:
    try:
        where.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(f"{FLAG} {where!r}: the only placeholder is {TEMPLATE} ({error!r})") from None
