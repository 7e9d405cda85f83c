"""Which policies of a run of several have finished training: the run stops once all of them have.

A policy's learner that finished says so once and exits, so a controller restarted after that would never hear it
again, and would wait for that policy to the end of the run. The record is therefore kept in RUN_DIR, written at
each finish and read back by a restarted controller. It belongs to one start of the run (the run clock's origin,
`ActorSettings.clock_origin`): a resumed run, whose learners may have more to train, starts from nothing, and a
policy whose training is already complete says so again as soon as its learner starts. A controller started
without the run clock (outside the launcher) keeps the record in memory only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "finished-policies.json"


class FinishedPolicies:
    def __init__(self, policies: tuple[str, ...], run_dir: Path, clock_origin: float | None) -> None:
        """`policies`: the run's, in declaration order; () for a run of one unnamed policy (nothing is recorded).
        Policies that join or leave the running job are added and removed (`policy_table.py`)."""
        self.policies = list(policies)
        self._path = run_dir / FILE
        self._origin = clock_origin
        self.reasons: dict[str, str] = self._read() if policies and clock_origin is not None else {}

    def finish(self, policy: str, reason: str) -> None:
        if policy not in self.policies:
            known = ", ".join(self.policies) or "none: the run has one unnamed policy"
            raise KeyError(f"policy {policy!r} is not one of the run's policies ({known})")
        self.reasons[policy] = reason
        self._write()

    def _write(self) -> None:
        if self._origin is None:
            return
        partial = self._path.with_name(FILE + ".partial")
        partial.write_text(json.dumps({"clock_origin": self._origin, "finished": self.reasons}), encoding="utf-8")
        os.replace(partial, self._path)

    def add(self, policy: str) -> None:
        """A policy joined (again): it trains until its learner says it finished."""
        if policy not in self.policies:
            self.policies.append(policy)
        if self.reasons.pop(policy, None) is not None:
            self._write()

    def remove(self, policy: str) -> None:
        """A policy left: the run no longer waits for it."""
        if policy in self.policies:
            self.policies.remove(policy)
        if self.reasons.pop(policy, None) is not None:
            self._write()

    @property
    def training(self) -> list[str]:
        """The policies still training."""
        return [policy for policy in self.policies if policy not in self.reasons]

    @property
    def all_done(self) -> bool:
        return bool(self.policies) and not self.training

    def summary(self) -> str:
        return "; ".join(f"{policy}: {self.reasons[policy]}" for policy in self.policies if policy in self.reasons)

    def _read(self) -> dict[str, str]:
        """This start's record (a restarted controller's), else nothing: another start's, or none, or unreadable."""
        try:
            saved = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(saved, dict) or saved.get("clock_origin") != self._origin:
            return {}
        finished = saved.get("finished")
        if not isinstance(finished, dict):
            return {}
        return {str(policy): str(reason) for policy, reason in finished.items() if policy in self.policies}
