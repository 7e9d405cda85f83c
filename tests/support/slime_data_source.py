"""slime-style data sources (``--data-source-path``), written as a slime user writes one against slime's
``DataSource``: a counting source whose state is its offset (saved as JSON under ``args.save``), and broken ones
whose answers the buffer must refuse by name. Every call is recorded in ``CALLS`` (a test clears it)."""

from __future__ import annotations

import json
import os
from typing import Any

from actors.slime_compat import DataSource, Sample

CALLS: list[tuple[str, Any]] = []  # (method, argument), in call order, across instances (a resumed buffer builds anew)


class CountingSource(DataSource):
    """Prompts "q0", "q1", ... with label = the number, ``n_samples_per_prompt`` copies per group."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.offset = 0
        CALLS.append(("init", args.save))

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_samples):
            prompt = f"q{self.offset}"
            groups.append([Sample(prompt=prompt, label=str(self.offset), metadata={"source": "counting"})
                           for _ in range(self.args.n_samples_per_prompt)])
            self.offset += 1
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        CALLS.append(("add_samples", len(samples)))

    def save(self, rollout_id: int) -> None:
        CALLS.append(("save", rollout_id))
        path = os.path.join(self.args.save, f"rollout/counting_{rollout_id}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"offset": self.offset}, handle)

    def load(self, rollout_id: int | None = None) -> None:
        CALLS.append(("load", rollout_id))
        with open(os.path.join(self.args.load, f"rollout/counting_{rollout_id}.json"), encoding="utf-8") as handle:
            self.offset = json.load(handle)["offset"]

    def __len__(self) -> int:
        return 1_000_000


class ShortGroups(CountingSource):
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return [group[:1] for group in super().get_samples(num_samples)]


class MixedPrompts(CountingSource):
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = super().get_samples(num_samples)
        groups[0][-1].prompt = "another prompt"
        return groups


class Raises(CountingSource):
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        raise KeyError("shard-7")


class RunsDry(CountingSource):
    """Two groups, then nothing."""

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return super().get_samples(num_samples) if self.offset < 2 else []


class NoSave:
    """Not a data source: it lacks save and load."""

    def __init__(self, args: Any) -> None:
        pass

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return []
