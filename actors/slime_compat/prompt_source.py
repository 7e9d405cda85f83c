"""slime's ``--data-source-path``: a user's ``DataSource`` as the buffer's stream of new prompt groups.

slime's rollout manager asks its data source for ``n`` groups per rollout and saves it with each checkpoint. Here the
buffer owns every group once it exists: it names it, leases it, re-issues it when a worker dies, logs it and trains
it exactly once. So the source is asked only for new prompts, one group at a time (``get_samples(1)``), and each
group becomes one prompt group, its prompt, label and metadata those of its samples. A group that must be generated
again never goes back to the source (``add_samples`` is not called): the buffer re-issues it under its own id, which
is what keeps it from being trained twice; a rollout function's put-back groups are held by its worker
(``actors/slime_compat/data_source.py``).

State: the source is built with slime's ``args``, ``args.save`` and ``args.load`` pointing at the run's
``buffer/data_source`` folder. At each learner checkpoint the buffer calls ``save(rollout_id)`` (slime's rollout id of
the checkpoint's last batch) and logs how many groups the source had given by then; a resumed buffer calls
``load(rollout_id)`` of the last one logged and draws (and discards) the groups given after it, which its log already
holds. A source that gives the same groups again from a loaded state resumes exactly where it was.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.config import RunConfig
from actors.data.prompts import Cursor, PromptRecord, PromptStreamError
from actors.slime_compat.args import build_args
from actors.slime_compat.sample import Sample
from bus.codec import encode
from bus.schema import PromptGroup
from policies.plugins import PluginError, load_object

__all__ = ["FLAG", "DataSource", "SlimeSourceStream"]

FLAG = "--data-source-path"
METHODS = ("get_samples", "save", "load")


class DataSource(abc.ABC):
    """slime's data-source interface (what ``from slime.rollout.data_source import DataSource`` imports here);
    the buffer calls ``get_samples``, ``save`` and ``load``."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """``num_samples`` groups of ``n_samples_per_prompt`` samples of one prompt each."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """slime's put-back; never called by the buffer (it re-issues groups itself)."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Keep the source's state under ``args.save`` for ``rollout_id``."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Restore what ``save(rollout_id)`` kept, from ``args.load``."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Groups the source holds (slime derives epochs from it; here --num-rollout says how long a run is)."""


class SlimeSourceStream:
    """A user's slime data source as a `PromptStream` (actors/data/prompts.py), on the buffer's event loop."""

    def __init__(self, source: Any, *, path: str, n_samples: int) -> None:
        missing = [name for name in METHODS if not callable(getattr(source, name, None))]
        if missing:
            raise PluginError(f"{FLAG} {path}: {type(source).__name__} has no {', '.join(missing)} (slime's "
                              "DataSource interface: get_samples(n), add_samples(groups), save(rollout_id), "
                              "load(rollout_id))")
        self.source, self.path, self.n_samples = source, path, n_samples
        self.cursor = Cursor()  # position: the groups the source has given

    @classmethod
    def load(cls, config: RunConfig, folder: Path) -> SlimeSourceStream:
        """The run's source, built as slime builds it (``cls(args)``) with its state kept in `folder`."""
        path = config.source.data_source_path or ""
        factory = load_object(path, what=FLAG)
        if not callable(factory):
            raise PluginError(f"{FLAG} {path}: {type(factory).__name__} is not a class")
        folder.mkdir(parents=True, exist_ok=True)
        args = build_args(config)
        args.save = args.load = str(folder)
        try:
            source = factory(args)
        except Exception as error:
            raise PluginError(f"{FLAG} {path}: building it with args raised {type(error).__name__}: {error}") \
                from error
        return cls(source, path=path, n_samples=config.rollout.n_samples_per_prompt)

    # ------------------------------------------------------------------------------------- PromptStream
    def next(self) -> tuple[PromptRecord, Cursor] | None:
        groups = self._call("get_samples(1)", self.source.get_samples, 1)
        if not isinstance(groups, list):
            raise PromptStreamError(f"{FLAG} {self.path}: get_samples(1) returned {type(groups).__name__}; expected "
                                    "a list of groups (lists of Sample)")
        if not groups:
            return None
        if len(groups) != 1:
            raise PromptStreamError(f"{FLAG} {self.path}: get_samples(1) returned {len(groups)} groups")
        record = self._record(groups[0])
        self.cursor = Cursor(0, self.cursor.position + 1)
        return record, self.cursor

    def save(self, rollout_id: int) -> dict[str, Any]:
        self._call(f"save({rollout_id})", self.source.save, rollout_id)
        return {"rollout_id": rollout_id, "drawn": self.cursor.position}

    def seek(self, cursor: Cursor, saved: dict[str, Any] | None) -> None:
        """The source as it was at `saved` (as built, without one), then past the groups given since: the buffer's
        log holds them, and re-issues those not yet trained."""
        drawn = 0
        if saved is not None:
            self._call(f"load({saved['rollout_id']})", self.source.load, saved["rollout_id"])
            drawn = int(saved["drawn"])
        for _ in range(max(cursor.position - drawn, 0)):
            if not self._call("get_samples(1)", self.source.get_samples, 1):
                break
        self.cursor = cursor

    # ----------------------------------------------------------------------------------------------- helpers
    def _call(self, what: str, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except PromptStreamError:
            raise
        except Exception as error:
            raise PromptStreamError(f"{FLAG} {self.path}: {what} raised {type(error).__name__}: {error}") from error

    def _record(self, group: Any) -> PromptRecord:
        """One group of the source as the prompt record the buffer makes a prompt group of."""
        where = f"{FLAG} {self.path}: get_samples(1) group {self.cursor.position}"
        if not isinstance(group, list) or len(group) != self.n_samples:
            size = f"{len(group)} samples" if isinstance(group, list) else type(group).__name__
            raise PromptStreamError(f"{where}: expected a list of n_samples_per_prompt = {self.n_samples} samples, "
                                    f"got {size}")
        first = group[0]
        prompt = getattr(first, "prompt", None)
        if not isinstance(prompt, (str, list)):
            raise PromptStreamError(f"{where}: sample.prompt is {type(prompt).__name__}; expected text or chat "
                                    "messages")
        if any(getattr(sample, "prompt", None) != prompt for sample in group):
            raise PromptStreamError(f"{where}: its samples have different prompts; a group here is one prompt "
                                    f"answered {self.n_samples} times")
        if getattr(first, "multimodal_inputs", None):
            raise PromptStreamError(f"{where}: sample.multimodal_inputs is set; a source's images are not carried "
                                    "(give them as --multimodal-keys columns of --prompt-data)")
        metadata = getattr(first, "metadata", None) or {}
        if not isinstance(metadata, dict):
            raise PromptStreamError(f"{where}: sample.metadata is {type(metadata).__name__}; expected a dict")
        label = getattr(first, "label", None)
        try:
            encode(PromptGroup(group_id="check", prompt=prompt, label=label, metadata=metadata))
        except (TypeError, ValueError) as error:
            raise PromptStreamError(f"{where}: its prompt, label or metadata cannot travel on the bus "
                                    f"(msgpack: {error})") from None
        return PromptRecord(data_index=self.cursor.position, prompt=prompt, label=label, metadata=dict(metadata))
