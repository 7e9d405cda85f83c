"""`python -m tools.gpu.check --cpu` in CI: the GPU machine's one command must not rot between GPU sessions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.system
@pytest.mark.timeout(600)
def test_gpu_check_cpu_mode_passes_every_check(tmp_path: Path) -> None:
    """The megatron run is listed, not run: tests/system/test_megatron_run.py runs the same launcher run (megatron
    on the CPU, TP=1, 4 steps of 4 x 4 samples, --max-staleness 1) and asserts more of it; the row's code is
    check_run, which the colocated row runs here. The torch run likewise: the suite's small fully-async runs
    (tests/system/test_fault_tolerance.py's `launch`, e.g. test_integrity_run.py's) are that run and assert more of
    it, and its weights over gloo are the CPU default (tests/actors/test_placement.py). The megatron-step row too:
    its benchmark, in its command, runs in tests/tools/test_bench_megatron_packing.py, which asserts the row made
    from its rows."""
    report = tmp_path / "gpu_check.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.gpu.check", "--cpu", "--quick", "--skip", "megatron", "megatron-step", "run",
         "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=580, check=False, env=env_without_quiet_switches(),
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(report.read_text())["rows"]}
    assert len(rows) == 8, sorted(rows)
    assert all(row["status"] in ("ok", "skipped") for row in rows.values()), rows
    assert rows["megatron"] == {**rows["megatron"], "status": "skipped", "result": "--skip"}, rows
    assert rows["run"] == {**rows["run"], "status": "skipped", "result": "--skip"}, rows
    assert rows["run: colocated, LoRA adapter"]["status"] == "ok"
    assert "weights over shm" in rows["run: colocated, LoRA adapter"]["result"]
    pushes = re.search(r"\((\d+) pushes, (\d+) beside a step\)", rows["run: colocated, LoRA adapter"]["result"])
    assert pushes and int(pushes[1]) >= 4 and int(pushes[2]) <= int(pushes[1]), rows  # at least one push a step
    assert rows["megatron-step"] == {**rows["megatron-step"], "status": "skipped", "result": "--skip"}, rows
    assert "Slipstream GPU check on CPU" in completed.stdout
    assert re.search(r"Transformer Engine (present|absent), apex (present|absent)", completed.stdout)
    # its console: a line per row started and ended, none of what libraries print by themselves
    assert not PROGRESS_BAR.search(completed.stderr), completed.stderr[-3000:]
    assert "Warning" not in completed.stderr, completed.stderr[-3000:]


@pytest.mark.system
@pytest.mark.timeout(400)
def test_the_gpu_session_script_runs_its_probe_and_engine_stages_on_the_cpu(tmp_path: Path) -> None:
    """`tools/gpu/session.sh --cpu`: the staged script a GPU session runs as one command, with the probe and the
    real-shape engine benchmark on the CPU (a tiny shape), each leaving its JSON."""
    completed = subprocess.run(
        ["bash", "tools/gpu/session.sh", str(tmp_path), "--cpu", "probe", "engine"], cwd=REPO, capture_output=True,
        text=True, timeout=380, check=False, env={**env_without_quiet_switches(), "PYTHON": sys.executable},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "== probe rc=0" in completed.stdout and "== engine rc=0" in completed.stdout, completed.stdout[-3000:]
    probes = json.loads((tmp_path / "probe.json").read_text())
    assert set(probes) == {"versions", "varlen_attn", "decode step", "cuBLAS rows"}
    assert not any(result.startswith("FAILED") for result in probes.values()), probes
    engine = json.loads((tmp_path / "engine.json").read_text())
    sides = {row["side"]: row for row in engine["rows"]}
    assert set(sides) == {"generate", "dynamic", "static-eager", "static-graphs"}, engine
    assert all(row["tokens"] == sides["generate"]["tokens"] > 0 for row in sides.values()), engine


@pytest.mark.integration
def test_the_train_row_runs_on_a_benchmark_model_of_another_shape() -> None:
    """`--train-shape`: the GPU session's real-shape train row (qwen2.5-0.5b there; the tiny model here)."""
    from tools.gpu.check import check_train_step

    row = check_train_step("cpu", quick=True, shape="tiny")
    assert row.status == "ok" and "4 x 64 tokens" in row.result, row


@pytest.mark.unit
def test_a_skipped_check_that_does_not_exist_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.gpu.check import main

    with pytest.raises(SystemExit) as exited:
        main(["--cpu", "--skip", "megatron", "megatorn"])
    assert exited.value.code == 2
    assert "--skip: no check named megatorn (the checks: tests run megatron" in capsys.readouterr().err
