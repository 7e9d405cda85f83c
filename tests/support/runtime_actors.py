"""Custom actors used by the runtime tests; loaded by dotted path in real launcher processes."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

from actors.config import ConfigError
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.handlers import handles
from bus.schema import GeneratedGroup, Roster, Sample


class RosterRecorder(Actor):
    """Writes every roster event it hears to RUN_DIR/roster_events.jsonl and the live members to
    RUN_DIR/roster_members.json."""

    async def on_roster(self, roster: Roster) -> None:
        with open(self.context.run_dir / "roster_events.jsonl", "a", encoding="utf-8") as handle:
            for event in roster.events:
                handle.write(json.dumps({"kind": event.kind, "actor_id": event.actor_id}) + "\n")
        alive = sorted(m.actor_id for m in roster.members if m.alive)
        (self.context.run_dir / "roster_members.json").write_text(json.dumps(alive), encoding="utf-8")


class Producer(Actor):
    """Streams groups of samples to the `consumer` role as fast as credits allow."""

    async def run(self) -> None:
        consumers = self.peer_stream("consumer")
        sequence = 0
        while not self.stopping:
            sample = Sample(sample_id=f"{self.actor_id}-{sequence}/0", group_id=f"{self.actor_id}-{sequence}",
                            index=0, prompt="p", prompt_tokens=1, tokens=np.arange(4, dtype=np.int32),
                            response="r", response_length=3)
            await consumers.send(GeneratedGroup(lease_id="-", group_id=sample.group_id, samples=[sample],
                                                worker_id=self.actor_id), timeout=30)
            sequence += 1
            await asyncio.sleep(0.01)


class Consumer(Actor):
    """Counts what it receives, per producer, into RUN_DIR/consumed-<pid>.json."""

    async def on_start(self) -> None:
        self.received: dict[str, int] = {}

    @handles(GeneratedGroup)
    async def on_group(self, sender: str, group: GeneratedGroup) -> None:
        self.received[group.worker_id] = self.received.get(group.worker_id, 0) + 1
        path = self.context.run_dir / f"consumed-{os.getpid()}.json"
        path.write_text(json.dumps(self.received), encoding="utf-8")


class Crasher(Actor):
    """Fails shortly after it starts, every time."""

    async def run(self) -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("crashing on purpose")


class MisconfiguredWhenBuilt(Actor):
    """Refuses its settings while it is built, as an actor does with a setting that cannot work."""

    def __init__(self, context: ActorContext) -> None:
        raise ConfigError("--custom-threshold 7: must be below 1")


class MisconfiguredWhenStarting(Actor):
    """Finds its settings wrong while it starts, as a role that loads its plugins and models in on_start does."""

    async def on_start(self) -> None:
        raise ConfigError("--custom-threshold 7: must be below 1 (found while starting)")


class SettingsRecorder(Actor):
    """Writes the run settings it was given to RUN_DIR/settings-ACTOR_ID.json."""

    async def on_start(self) -> None:
        path = self.context.run_dir / f"settings-{self.actor_id}.json"
        path.write_text(self.settings.run.model_dump_json(), encoding="utf-8")


class SlowToStop(Actor):
    """Takes a minute to drain, as a learner finishing a long step and writing its checkpoint would."""

    drain_timeout = 90.0

    async def on_stop(self) -> None:
        await asyncio.sleep(float(os.environ.get("SLOW_TO_STOP_S", "60")))
        (self.context.run_dir / f"{self.actor_id}.drained").write_text("drained", encoding="utf-8")


class SlowToStart(Actor):
    """Takes a minute to start, as an actor loading a large model or waiting for its SGLang server would; writes
    RUN_DIR/ACTOR_ID.starting once it is under way."""

    async def on_start(self) -> None:
        (self.context.run_dir / f"{self.actor_id}.starting").write_text("starting", encoding="utf-8")
        await asyncio.sleep(60)
