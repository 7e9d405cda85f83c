"""A slime run script runs end to end when `python3 train_async.py` is replaced by `python launcher.py --head`.

The fully async 0.5B script of `tests/data/slime_scripts/` runs on CPU with the tiny model and a small prompt file
substituted for its MODEL_DIR and DATA_PATH, its output folders moved under the test's tmp dir, and one override a
CPU needs: `--train-backend torch` (slime's only backend, Megatron, which `--slime-entry` implies, needs GPUs).
The script's GPU counts (`--actor-num-gpus-per-node 1 --rollout-num-gpus 1`) stay: they size one learner rank
and one rollout worker, which is what they mean on a machine without GPUs too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.slime_scripts import SCRIPTS, read_slime_script, run_slime_script


@pytest.mark.system
def test_fully_async_slime_script_trains_on_cpu(tiny_model_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)), encoding="utf-8")
    entry, argv = read_slime_script(SCRIPTS / "fully-async-qwen2.5-0.5b.sh",
                                    overrides={"MODEL_DIR": str(tiny_model_path), "DATA_PATH": str(data)})
    argv[argv.index("--save") + 1] = str(tmp_path / "save")
    argv[argv.index("--save-debug-rollout-data") + 1] = str(tmp_path / "debug" / "{rollout_id}.pt")
    completed, steps = run_slime_script(entry, argv, tmp_path / "run")
    assert "slime flags accepted with no effect here" in completed.stderr
    assert "--rollout-health-check-interval" in completed.stderr
    assert len(steps) == 3
    assert sorted(p.name for p in (tmp_path / "debug").glob("batch_*.msgpack")) == [
        "batch_000001.msgpack", "batch_000002.msgpack", "batch_000003.msgpack"]
