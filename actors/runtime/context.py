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

from bus.address import bind_address


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
    settings: dict[str, Any] = field(default_factory=dict)  # the role's own configuration
    # The GPUs this process owns, as its CUDA_VISIBLE_DEVICES (set by the supervisor and again by
    # actors.runtime.main, so a process started by hand gets the same devices); None leaves the variable as is.
    cuda_visible_devices: str | None = None

    def to_json(self) -> str:
        data = asdict(self)
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
        return self.run_dir / "sockets"

    def bind_address(self, channel: str) -> str:
        """Where this actor binds `channel` ("inbox", "rpc", ...): bus.address's rule (IPv6 brackets, ipc path
        limits) applied to this actor's host, transport and sockets folder."""
        transport = cast(Literal["tcp", "ipc"], self.transport)  # bus.address rejects anything else, by name
        return bind_address(self.host, transport, self.sockets_dir, f"{self.actor_id}-{channel}")

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"
