"""--use-wandb: the metrics files reach a real (offline) W&B run once each, across a controller restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.controller.wandb_mirror import WandbMirror
from actors.runtime.metrics import MetricsWriter

pytest.importorskip("wandb")


def open_mirror(run_dir: Path) -> WandbMirror:
    return WandbMirror(run_dir, project="slipstream-test", group=None, mode="offline", config={"lr": 1e-4})


def wandb_bytes(run_dir: Path) -> bytes:
    """Everything W&B wrote for the run (history records keep keys and JSON values as text in the binary log)."""
    return b"".join(path.read_bytes() for path in sorted((run_dir / "wandb").rglob("*.wandb")))


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

    written = wandb_bytes(run_dir)
    for text in ("train/loss", "0.123456789", "0.223456789", "0.323456789", "0.423456789", "train/rollout/reward_mean",
                 "eval/heldout/accuracy", "0.3456789", "train/step"):
        assert text.encode() in written, text
    assert b"s-987654321" not in written
    assert b"eval/eval/" not in written  # keys already namespaced by their file are not prefixed twice
    state = json.loads((run_dir / "wandb" / "mirror_state.json").read_text())
    assert state["run_id"] == run_id
    assert state["offsets"]["train"] == train.path.stat().st_size
