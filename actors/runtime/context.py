"""What an actor process is told about itself when it starts.

The launcher writes one JSON file per actor (identity, head address, run directory, the role's settings) and
passes its path; the process never reads global state or environment variables for its configuration, so
the same actor can be started by hand for debugging with exactly what the launcher gave it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from actors.config import RunConfig
from bus.address import bind_address, ipc_sockets_dir


class ActorSettings(BaseModel):
    """What the launcher tells an actor beyond who and where it is: typed, so a misspelt or mistyped setting fails
    when the context is read, not when the one code path that reads it runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    log_level: str = "info"  # the actor's log file
    console_log_level: str = "info"
    run: RunConfig = Field(default_factory=RunConfig)  # the whole run's configuration; each role reads its sections
    expected_roles: dict[str, int] = Field(default_factory=dict)  # controller: role -> actors it waits for
    heartbeat_deadline: float | None = Field(None, gt=0)  # controller: silence before a member counts as dead
    stream_window: int = Field(16, ge=1)  # credits of this actor's inbound stream
    # --restart-backoff: the first wait before restarting what an actor itself keeps running (a node's learner ranks)
    restart_backoff: float = 0.5
    custom: dict[str, Any] = Field(default_factory=dict)  # a user-written actor's own settings, as given
    # The run's clock (actors/report/run_clock.py): the epoch seconds at which it read 0, which the head's launcher
    # gives every actor it starts and restarts, so metrics `time` goes on across restarts; None: from the writer.
    clock_origin: float | None = None


@dataclass(frozen=True)
class ActorContext:
    actor_id: str
    role: str
    actor_class: str  # dotted path `package.module:ClassName`
    node_rank: int
    head_address: str  # the controller's request/reply endpoint, tcp://HOST:PORT
    run_dir: Path
    host: str = "127.0.0.1"  # address this actor binds and advertises for its own endpoints
    transport: str = "tcp"  # "tcp" or "ipc" for this actor's inbound endpoints
    curve_keys_dir: Path | None = None
    heartbeat_interval: float = 1.0
    settings: ActorSettings = field(default_factory=ActorSettings)  # a mapping is validated into ActorSettings
    # The GPUs this process owns, as its CUDA_VISIBLE_DEVICES (set by the supervisor and again by
    # actors.runtime.main, so a process started by hand gets the same devices); None leaves the variable as is.
    cuda_visible_devices: str | None = None
    # This process's CPU share (actors.runtime.cpu_budget): the cores it may run on and its torch threads;
    # None leaves the OS's placement and --torch-threads.
    cpu_cores: tuple[int, ...] | None = None
    torch_threads: int | None = None
    # The policy whose actor this is (its buffer, learner or evaluator) in a run of several (actors.config.policies):
    # its settings are the policy's, and its peers of a policy's role are those of its own policy. None: shared.
    policy: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.settings, ActorSettings):
            object.__setattr__(self, "settings", ActorSettings.model_validate(self.settings))
        if self.cpu_cores is not None:  # JSON brings a list back
            object.__setattr__(self, "cpu_cores", tuple(int(core) for core in self.cpu_cores))

    def to_json(self) -> str:
        data = asdict(self)
        data["settings"] = self.settings.model_dump(mode="json")
        data["run_dir"] = str(self.run_dir)
        data["curve_keys_dir"] = str(self.curve_keys_dir) if self.curve_keys_dir else None
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> ActorContext:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not valid JSON ({error})") from error
        missing = [name for name in ("actor_id", "role", "actor_class", "node_rank", "head_address", "run_dir")
                   if name not in data]
        if missing:
            raise ValueError(f"{source}: actor context lacks {', '.join(missing)}")
        data["run_dir"] = Path(data["run_dir"])
        if data.get("curve_keys_dir"):
            data["curve_keys_dir"] = Path(data["curve_keys_dir"])
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{source}: unknown actor context keys {sorted(unknown)}")
        return cls(**data)

    @property
    def sockets_dir(self) -> Path:
        return ipc_sockets_dir(self.run_dir)

    def bind_address(self, channel: str) -> str:
        """Where this actor binds `channel` ("inbox", "rpc", ...): bus.address's rule (IPv6 brackets, ipc path
        limits) applied to this actor's host, transport and sockets folder."""
        transport = cast(Literal["tcp", "ipc"], self.transport)  # bus.address rejects anything else, by name
        return bind_address(self.host, transport, self.sockets_dir, f"{self.actor_id}-{channel}")

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"
