"""The delta-sync benchmarks still run end to end on the tiny model (their figures are not asserted beyond what
the tiny model's training must show).

Each runs as it does from the command line, in a process of its own, forked from this one (which imported torch
and the benchmarks once, and runs torch on one thread: tests/conftest.py) instead of a new interpreter that
imports them again (tools/bench/forked.py)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tools.bench.forked import forked_output


def _run(module: str, errors: Path) -> str:
    main = importlib.import_module(module).main  # here, before the fork: the next test's fork finds it imported
    code, out = forked_output(lambda: main(["--quick", "--steps", "2"]), errors)
    assert code == 0, errors.read_text()[-2000:]
    return out


@pytest.mark.integration
def test_the_measurement_of_changed_elements_reports_each_wire_dtype(tmp_path: Path) -> None:
    out = _run("tools.bench.weight_deltas", tmp_path / "errors")
    overall = re.search(r"^overall\s+[\d,]+\s+([\d.]+)%.*?\s+([\d.]+)%", out, re.MULTILINE)
    assert overall is not None, out
    assert float(overall.group(1)) > 50  # float32: an Adam step moves nearly every element
    assert "encodings chosen: dense" in out


@pytest.mark.integration
def test_the_push_benchmark_sends_deltas_after_the_first_push_against_a_full_baseline(tmp_path: Path) -> None:
    out = _run("tools.bench.delta_push", tmp_path / "errors")
    assert "full (baseline)" in out and "(2 of 2 pushes were deltas)" in out
    assert "delta wins below a link of: float32:" in out
