"""The learner's record of what every push's fingerprint check found (`--weight-check`), for the run's certificate.

One JSON line per push attempt in RUN_DIR/metrics/weight_checks.jsonl: the version, the engines that serve
exactly what was sent, those that serve other bits (with the tensors, and `why` where the difference shows only as
a whole: SGLang's checksums), those that could not be checked (with the reason), what fingerprinting cost each end
(`seconds`: the sender, and each engine while its generation waited), or why the push was not checked at all.
`actors/report/integrity.py` turns the file into a verdict.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TextIO

from actors.runtime.metrics import clock_fields
from engines.weights.fingerprint import FingerprintCheck

FILE = "weight_checks.jsonl"


class WeightsCorrupted(RuntimeError):
    """An engine serves other weights than the learner pushed, under `--weight-check strict`: the run stops."""


class WeightCheckLog:
    def __init__(self, metrics_dir: Path | None, *, clock_origin: float | None = None) -> None:
        """`clock_origin`: the run's clock (`ActorSettings.clock_origin`); without one, from this log's opening."""
        self._file: TextIO | None = None
        self._origin = time.time() if clock_origin is None else clock_origin
        if metrics_dir is not None:
            metrics_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(metrics_dir / FILE, "a", buffering=1)  # noqa: SIM115 - kept open for the run

    def checked(self, version: int, check: FingerprintCheck) -> None:
        # `why` only where a difference shows as a whole (SGLang's checksums), not tensor by tensor
        why = {"why": check.why} if check.why else {}
        seconds = {"seconds": {end: round(spent, 4) for end, spent in check.seconds.items()}} if check.seconds else {}
        self._write({"version": version, "algorithm": check.algorithm, "matched": list(check.matched),
                     "differ": check.differ, "unchecked": check.unchecked, **why, **seconds})

    def not_checked(self, version: int, why: str) -> None:
        self._write({"version": version, "not_checked": why})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, object]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({**clock_fields(self._origin), **record}) + "\n")
