"""A prompt file where one row in ten has no label, through launcher.py: the run trains only the labelled rows and
says how many it left out (a label-less row would be scored as wrong every time and trained on as such)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bus.codec import decode
from tests.system.test_fault_tolerance import finish, launch


@pytest.mark.system
@pytest.mark.timeout(300)
def test_rows_without_a_label_are_left_out_of_training_and_counted(tmp_path: Path, tiny_model_path: Path) -> None:
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10)]
    unlabelled = {rows[i]["input"] for i in range(0, 100, 10)}
    for i in range(0, 100, 10):
        rows[i] = {"input": rows[i]["input"], "answer": rows[i]["label"]}  # the label under another name
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    recorded = tmp_path / "batches"
    # every labelled prompt is served at least once in 30 groups (an epoch is 90), so an unlabelled one would be too
    run = launch(tmp_path / "run", tiny_model_path, data, num_rollout=8,
                 extra=("--rollout-batch-size", "12", "--save-debug-rollout-data", str(recorded)))
    output = finish(run)
    assert run.returncode == 0, output[-3000:]
    said = f"skipped 10 of 100 records of {data} as malformed, the first at line 1: label key 'label' missing"
    assert said in output
    batches = [decode(path.read_bytes()) for path in sorted(recorded.glob("batch_*.msgpack"))]
    samples = [sample for batch in batches for sample in batch.samples]
    assert len(samples) == 8 * 12 * 4
    assert all(sample.label is not None for sample in samples)
    assert not {sample.prompt for sample in samples} & unlabelled
