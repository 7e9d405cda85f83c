"""Which policies a run of several has now: those declared at start, those that joined since, less those that left.

Policies join and leave a running job as nodes do (docs/multi-policy.md "Policies that join and leave"). The
controller holds the table and is the one to change it: a launcher asks it to add a policy (`PolicyJoin`) before it
starts the policy's buffer, learner and evaluator (and its rollout workers, for one with engines of its own), and
anyone may ask it to take one out (`PolicyLeave`). Every change goes out in the roster (`Roster.policies`), so the
reward workers open or close the policy's scoring and the shared rollout workers its lane (one on the run's shared
engines only), and the policy's own actors, whose heartbeats are answered `policy_left` from then on, stop (the
learner checkpoints first). A policy that left may join again under its name: its learner resumes from its
checkpoint and its buffer from its log, so nothing it trained is trained again.

A join is checked as the run's start checks `policies:` (the name, each setting a policy may set, their values), and,
for a policy on the run's shared engines, against what they have room for (one with engines of its own,
`own_engines`, takes none): by the run's settings (`policy_capacity`), and by what each live shared rollout worker
said of its engine when it registered (`ADAPTER_ROOM`: an SGLang server's `--max-loras-per-batch`, the one way to know
an attached server's, which the controller cannot ask itself). A restarted controller reads the table back from
RUN_DIR, for the same start of the run only (the run clock's origin, as `finished.py` does): a resumed run starts
from its declared policies, and the others join it again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actors.config import RunConfig
from actors.config.policies import (
    ADAPTER_ROOM,
    ADAPTER_ROOM_WHY,
    own_engine_workers,
    policy_capacity,
    sharing_engines,
)

FILE = "policy-table.json"


class PolicyRefused(ValueError):
    """A join or a leave the run cannot take; the message names the policy and why."""


class PolicyTable:
    def __init__(self, config: RunConfig, run_dir: Path, clock_origin: float | None) -> None:
        self.config = config  # the run's, with the policies it declared
        self.live: dict[str, dict[str, Any]] = dict(config.policies)
        self.left: dict[str, str] = {}  # policy -> why it left
        self._path = run_dir / FILE
        self._origin = clock_origin
        if config.policies and clock_origin is not None:
            self._read()

    @property
    def several(self) -> bool:
        """A run of several policies (a run of one unnamed policy has no table, and nothing joins it)."""
        return bool(self.config.policies)

    def join(self, policy: str, settings: dict[str, Any], *,
             rooms: Mapping[str, Mapping[str, Any]] | None = None) -> bool:
        """Add `policy` with `settings`; False when it is in the run already with these very settings (a launcher
        asking again, or a node of the policy's restarting). `rooms`: each live shared rollout worker's registration
        facts. A policy with engines of its own (`own_engines`) takes no room on the shared engines. Raises
        PolicyRefused."""
        if not self.several:
            raise PolicyRefused(f"policy {policy!r} cannot join: this run has one unnamed policy; a run that policies "
                                "join declares its first ones under `policies:` (docs/multi-policy.md)")
        if policy in self.live:
            if self.live[policy] == settings:
                return False
            raise PolicyRefused(f"policy {policy!r} is in the run already, with other settings ({self.live[policy]}); "
                                "it must leave first (--leave-policy) to join again with new ones")
        if not own_engine_workers(settings):  # one with engines of its own takes no room on the run's
            self._check_room(policy, rooms or {})
        try:
            self.config.with_settings(policies={**self.live, policy: settings})
        except ValueError as error:  # SettingsError or pydantic's: each problem names the policy and the setting
            raise PolicyRefused(f"policy {policy!r} cannot join: {error}") from None
        self.live[policy] = dict(settings)
        self.left.pop(policy, None)
        self._write()
        return True

    def _check_room(self, policy: str, rooms: Mapping[str, Mapping[str, Any]]) -> None:
        """PolicyRefused when the run's shared engines hold no more adapters: by the run's settings, and by what the
        shared rollout workers said of theirs (`rooms`)."""
        engine, adapters = self.config.engine, sharing_engines(self.live)  # the adapters on the run's engines
        capacity = policy_capacity(engine.rollout_engine, len(sharing_engines(self.config.policies)),
                                   attached=bool(engine.sglang_url))
        if capacity is not None and len(adapters) >= capacity:
            raise PolicyRefused(f"policy {policy!r} cannot join: the engines have room for {capacity} policies' "
                                f"adapters and the run has {len(adapters)} ({', '.join(adapters)})")
        if (least := least_room(rooms)) is not None and len(adapters) >= least[0]:
            raise PolicyRefused(f"policy {policy!r} cannot join: {least[1]} has room for {least[0]} policies' "
                                "adapters (each policy's, the one it replaces while a push lands, and the base model) "
                                f"and the run has {len(adapters)} ({', '.join(adapters)})")

    def leave(self, policy: str, reason: str) -> None:
        if policy not in self.live:
            gone = f" (it left: {self.left[policy]})" if policy in self.left else ""
            raise PolicyRefused(f"policy {policy!r} is not in the run{gone}; its policies: "
                                f"{', '.join(self.live) or 'none'}")
        del self.live[policy]
        self.left[policy] = reason or "asked to leave"
        self._write()

    def _write(self) -> None:
        if self._origin is None:
            return
        partial = self._path.with_name(FILE + ".partial")
        partial.write_text(json.dumps({"clock_origin": self._origin, "live": self.live, "left": self.left}),
                           encoding="utf-8")
        os.replace(partial, self._path)

    def _read(self) -> None:
        """This start's table (a restarted controller's); nothing else: another start's, none, or unreadable."""
        try:
            saved = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if not isinstance(saved, dict) or saved.get("clock_origin") != self._origin:
            return
        live, left = saved.get("live"), saved.get("left")
        if isinstance(live, dict) and all(isinstance(v, dict) for v in live.values()):
            self.live = {str(k): v for k, v in live.items()}
        if isinstance(left, dict):
            self.left = {str(k): str(v) for k, v in left.items()}


def least_room(rooms: Mapping[str, Mapping[str, Any]]) -> tuple[int, str] | None:
    """The least adapter room the rollout workers said their engines have (actor id -> registration facts), and
    whose it is; None when none said."""
    said = [(facts[ADAPTER_ROOM], f"{actor}'s {facts.get(ADAPTER_ROOM_WHY) or 'engine'}")
            for actor, facts in sorted(rooms.items()) if isinstance(facts.get(ADAPTER_ROOM), int)]
    return min(said, key=lambda room: room[0]) if said else None
