"""The delta-sync and FP8 benchmarks still run end to end on the tiny model (their figures are not asserted beyond what
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


def _run(module: str, errors: Path, *extra: str) -> str:
    return _output(module, errors, ["--quick", "--steps", "2", *extra])


def _output(module: str, errors: Path, argv: list[str]) -> str:
    main = importlib.import_module(module).main  # here, before the fork: the next test's fork finds it imported
    code, out = forked_output(lambda: main(argv), errors)
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
    out = _run("tools.bench.delta_push", tmp_path / "errors", "--dtypes", "float32", "fp8")
    always = re.search(r"^float32 +delta, always .*\((\d) of 2 pushes were deltas\)$", out, re.MULTILINE)
    assert "full (baseline)" in out and always is not None and always.group(1) == "2", out
    assert re.search(r"^float32 +delta sync as run .*\(\d of 2 pushes were deltas\)$", out, re.MULTILINE), out
    assert re.search(r"^an always-delta push wins below a link of: .*float32: ", out, re.MULTILINE), out
    assert re.search(r"^delta sync as a run has it, .*float32: [\d.]+x", out, re.MULTILINE), out
    fp8_rows = re.findall(r"^fp8 +(full \(baseline\)|delta, always|delta sync as run) +([\d.]+)", out, re.MULTILINE)
    float32_full = re.search(r"^float32 +full \(baseline\) +([\d.]+)", out, re.MULTILINE)
    assert len(fp8_rows) == 3 and float32_full is not None, out
    assert float(fp8_rows[0][1]) < float(float32_full.group(1)) / 2, "an FP8 push carries under half of float32's"


@pytest.mark.integration
def test_the_fp8_rollout_benchmark_compares_each_precision_with_the_full_precision_baseline(tmp_path: Path) -> None:
    out = _output("tools.bench.fp8_rollout", tmp_path / "errors",
                  ["--quick", "--model", "tiny", "--prompts", "2", "--max-new-tokens", "8"])
    rows = dict(re.findall(r"^(fp32 \(baseline\)|bf16|fp8|fp8 \(bf16\)) +([\d.]+) ", out, re.MULTILINE))
    assert set(rows) == {"fp32 (baseline)", "bf16", "fp8", "fp8 (bf16)"}, out
    assert float(rows["fp32 (baseline)"]) < 1e-3 < float(rows["fp8"]), "the baseline scores as its trainer does"
    assert re.search(r"^tiny +\d+ +\d+ +\d+ +0\.\d+", out, re.MULTILINE), out


@pytest.mark.integration
def test_the_fp8_kernel_benchmark_shows_the_scaled_matmul_keeps_fewer_bytes_and_agrees(tmp_path: Path) -> None:
    out = _output("tools.bench.fp8_kernel", tmp_path / "errors",
                  ["--quick", "--model", "tiny", "--prompts", "2", "--max-new-tokens", "6"])
    resident = dict(re.findall(r"^(dequantised \(baseline\)|scaled_mm) +[\d.]+ +([\d.]+)$", out, re.MULTILINE))
    assert float(resident["scaled_mm"]) < float(resident["dequantised (baseline)"]) / 4, out
    assert all(float(relative) < 1e-5 for relative in re.findall(r" ([\d.e+-]+)$", out.split("\n\n")[0])[1:]), out
    scaled = re.search(r"^scaled_mm +(\d\.\d+e[+-]\d+) ", out, re.MULTILINE)  # teacher-forced
    assert scaled is not None and float(scaled.group(1)) < 1e-4, out
