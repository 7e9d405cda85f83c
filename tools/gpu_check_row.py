"""One row of `tools/gpu_check.py`'s table, shared by the modules whose checks fill it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    check: str
    status: str  # ok / FAILED / skipped
    result: str
    baseline: str = ""
    seconds: float = 0.0
