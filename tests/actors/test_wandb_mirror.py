"""--use-wandb: the metrics files reach a real (offline) W&B run once each, across a controller restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.controller.wandb_mirror import WandbMirror
from actors.runtime.metrics import MetricsWriter
from tests.support.wandb_log import settled_history

pytest.importorskip("wandb")


def open_mirror(run_dir: Path) -> WandbMirror:
    return WandbMirror(run_dir, project="slipstream-test", group=None, mode="offline", config={"lr": 1e-4})


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_metrics_reach_wandb_once_each_across_a_controller_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    train = MetricsWriter(run_dir, "train")
    train.write(1, {"loss": 0.123456789, "rollout/reward_mean": 0.25, "note": "text is not a metric"})
    train.write(2, {"loss": 0.223456789, "grad_norm": float("nan")})
    MetricsWriter(run_dir, "eval").write(2, {"eval/heldout/accuracy": 0.3456789})
    (run_dir / "metrics" / "trained_samples.jsonl").write_text('{"sample_id": "s-987654321"}\n')
    with open(train.path, "a", encoding="utf-8") as file:
        file.write('{"step": 3, "loss": 0.32345')  # a line the learner is still writing

    mirror = open_mirror(run_dir)
    assert mirror.pump() == 3  # two train records, one eval record; the torn line waits, the audit trail is skipped
    assert mirror.pump() == 0
    run_id = mirror.run.id
    mirror.close()

    with open(train.path, "a", encoding="utf-8") as file:
        file.write('6789}\nnot json\n{"step": 4, "loss": 0.423456789}\n')
    restarted = open_mirror(run_dir)
    assert restarted.run.id == run_id
    assert restarted.pump() == 2  # the completed line and step 4; nothing sent twice, the bad line skipped
    restarted.close()

    rows = settled_history(run_dir, lambda rows: sum("train/loss" in row for row in rows) >= 4)
    assert [row["train/loss"] for row in rows if "train/loss" in row] == [
        0.123456789, 0.223456789, 0.323456789, 0.423456789
    ]  # once each, in order, across the restart
    assert [row["train/step"] for row in rows if "train/step" in row] == [1, 2, 3, 4]
    assert [row["train/rollout/reward_mean"] for row in rows if "train/rollout/reward_mean" in row] == [0.25]
    assert [row["eval/heldout/accuracy"] for row in rows if "eval/heldout/accuracy" in row] == [0.3456789]
    keys = {key for row in rows for key in row}
    assert "train/grad_norm" not in keys and "train/note" not in keys  # NaN and text are not metrics
    assert not any(key.startswith("eval/eval/") for key in keys)  # keys namespaced by their file keep one prefix
    assert not any("s-987654321" in str(value) for row in rows for value in row.values())
    state = json.loads((run_dir / "wandb" / "mirror_state.json").read_text())
    assert state["run_id"] == run_id
    assert state["offsets"]["train"] == train.path.stat().st_size


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_wandb_run_id_names_the_run_and_that_run_gets_every_record(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's --wandb-run-id: the mirror logs into the W&B run of that id (resumed where it exists), even where
    this run directory mirrored into another run before; that run has none of the records yet, so it gets all."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    MetricsWriter(run_dir, "train").write(1, {"loss": 0.5})
    first = open_mirror(run_dir)
    assert first.pump() == 1
    first.close()
    assert first.run.id != "slime-run-7"

    named = WandbMirror(run_dir, project="slipstream-test", group=None, mode="offline", config={},
                        run_id="slime-run-7")
    assert named.run.id == "slime-run-7"
    assert named.pump() == 1  # the record the other run holds, sent into this one too
    named.close()
    assert json.loads((run_dir / "wandb" / "mirror_state.json").read_text())["run_id"] == "slime-run-7"
    assert any(path.name == "run-slime-run-7.wandb" for path in (run_dir / "wandb").rglob("*.wandb"))
