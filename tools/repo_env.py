"""The environment for a process this repository starts: the repository first on `PYTHONPATH`, the caller's
entries kept after it (on a GPU machine, the folder of carried wheels lives there; replacing it loses them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def with_repo_on_path(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A copy of `env` (default: this process's environment) with the repository on the path, plus `extra`."""
    result = dict(os.environ if env is None else env)
    result["PYTHONPATH"] = os.pathsep.join(part for part in (str(REPO), result.get("PYTHONPATH", "")) if part)
    result.update(extra)
    return result
