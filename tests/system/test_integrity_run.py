"""The integrity certificate in real runs through launcher.py: an engine whose load leaves one tensor other than
pushed stops a `--check-weight-update-equal` run (slime's flag: `--weight-check strict`) with the engine and the
tensor named, in the log and in RUN_DIR/integrity.json; the same run with honest engines certifies every push, and
that no token was sampled over an older cache, their prefix caches across requests included.

The honest run also reads a prompt file where one row in ten has no label: it must train only the labelled rows
and say how many it left out (a label-less row would be scored as wrong every time and trained on as such). And it
rolls out in FP8 (`--rollout-fp8`): every push quantised by the learner, loaded and certified as FP8 bytes. One run
checks all three, for the suite's time."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from actors.config import RunConfig
from actors.rollout.engine_factory import load_engine
from bus.codec import decode
from tests.system.test_fault_tolerance import finish, launch
from tools.make_arithmetic_data import make_arithmetic_data

if TYPE_CHECKING:  # the launcher imports this module for the engine's traits before any actor starts: not torch
    import torch

CORRUPTED = "model.layers.0.mlp.down_proj.weight"
# The run's only rollout worker: a run starts once one worker is there, and under load a second one joined after
# all 8 steps were over (CI), so a corrupting second engine was never pushed to and nothing failed.
CORRUPT_ENGINE = "rollout-0-0"


def engine_that_corrupts_one_tensor(config: RunConfig, actor_id: str | None) -> tuple[object, object]:
    """The built-in torch engine; in CORRUPT_ENGINE, every load from version 2 on leaves CORRUPTED slightly off,
    as a load path that skipped or clobbered a tensor would, and still acknowledges."""
    torch_engine = config.model_copy(update={"engine": config.engine.model_copy(update={"rollout_engine": "torch"})})
    engine, tokenizer = load_engine(torch_engine, actor_id)
    if actor_id == CORRUPT_ENGINE:
        load = engine._load_weights

        def load_then_corrupt(named: Iterable[tuple[str, torch.Tensor]], version: int, adapter: str | None) -> None:
            load(named, version, adapter)
            if version >= 2:
                engine._weights.parameters[CORRUPTED].data[0, 0] += 1e-3

        engine._load_weights = load_then_corrupt
    return engine, tokenizer


@pytest.mark.system
@pytest.mark.timeout(300)
def test_an_engine_serving_other_weights_stops_a_strict_run_naming_it_and_the_tensor(
        tmp_path: Path, tiny_model_path: Path) -> None:
    task = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    engine = "tests.system.test_integrity_run:engine_that_corrupts_one_tensor"
    run = launch(run_dir, tiny_model_path, task, num_rollout=8,
                 extra=("--check-weight-update-equal", "--rollout-engine", engine, "--rollout-workers", "1"))
    output = finish(run)
    assert run.returncode != 0, output[-3000:]
    assert f"{CORRUPT_ENGINE} serves other bits in {CORRUPTED}" in output
    certificate = json.loads((run_dir / "integrity.json").read_text())
    weights = certificate["checks"]["weights"]
    assert not certificate["ok"] and weights["verdict"] == "fail"
    # the first push the corrupting engine loads from version 2 on (it may join a push or two later), and no other
    [culprit] = weights["culprits"]
    assert culprit["version"] >= 2 and (culprit["engine"], culprit["tensors"]) == (CORRUPT_ENGINE, [CORRUPTED])
    # every push before the culprit matched on each engine that had joined it (an engine may join late under load)
    records = [json.loads(line) for line in (run_dir / "metrics" / "weight_checks.jsonl").read_text().splitlines()]
    earlier = [record for record in records if record["version"] < culprit["version"]]
    assert earlier and all(record["matched"] and not record.get("differ") for record in earlier), records


@dataclass(frozen=True)
class HonestRun:
    run_dir: Path
    output: str
    returncode: int
    data: Path
    unlabelled: set[str]
    recorded: Path


HONEST_STEPS, HONEST_BATCH = 8, 12


@pytest.fixture(scope="module")
def honest_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> HonestRun:
    """A strict run with honest engines serving FP8, on a prompt file where one row in ten has no label (under another
    key)."""
    tmp_path = tmp_path_factory.mktemp("honest")
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10)]
    unlabelled = {rows[i]["input"] for i in range(0, 100, 10)}
    for i in range(0, 100, 10):
        rows[i] = {"input": rows[i]["input"], "answer": rows[i]["label"]}  # the label under another name
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    recorded = tmp_path / "batches"
    run_dir = tmp_path / "run"
    # every labelled prompt is served at least once in 30 groups (an epoch is 90), so an unlabelled one would be too
    run = launch(run_dir, tiny_model_path, data, num_rollout=HONEST_STEPS,
                 extra=("--check-weight-update-equal", "--rollout-batch-size", str(HONEST_BATCH),
                        "--save-debug-rollout-data", str(recorded), "--rollout-fp8"))
    output = finish(run)
    return HonestRun(run_dir, output, run.returncode, data, unlabelled, recorded)


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_run_whose_engines_serve_what_was_pushed_certifies_every_push(honest_run: HonestRun) -> None:
    run_dir, output = honest_run.run_dir, honest_run.output
    assert honest_run.returncode == 0, output[-3000:]
    certificate = json.loads((run_dir / "integrity.json").read_text())
    weights = certificate["checks"]["weights"]
    assert certificate["ok"] and weights["verdict"] == "pass", weights
    committed = [line for line in (run_dir / "logs" / "learner.jsonl").read_text().splitlines()
                 if '"weights pushed"' in line]
    assert weights["pushes"] == len(committed) >= HONEST_STEPS  # every committed push was checked: one a step
    assert weights["engine_checks_matched"] >= weights["pushes"]  # one engine, or both once both joined
    assert (weights["served_differently"], weights["unchecked"]) == (0, 0)
    caches = certificate["checks"]["caches"]  # both engines' heartbeats said: no token over an older cache
    assert caches["verdict"] == "pass" and caches["engines"] == 2 and caches["stale_kv_tokens"] == 0, caches
    # ... with their prefix caches on: prompts share the chat template's head, so every prefill after an engine's
    # first finds it, reused at the same weights or counted as held from older ones (which of the two depends on
    # whether the learner pushed in between: a busy machine may push between every pair of batches)
    prefix = caches["prefix_cache"]
    assert prefix["reused_tokens"] + prefix["stale_tokens"] > 0 and "prefix cache:" in output, caches
    prompts = certificate["checks"]["prompts"]
    assert prompts["verdict"] == "pass" and prompts["skipped"] == 0
    assert prompts["fates"]["trained"] == HONEST_STEPS * HONEST_BATCH
    assert "integrity: OK" in output and "prompts: pass" in output


@pytest.mark.system
@pytest.mark.timeout(300)
def test_an_fp8_rollout_pushes_its_projections_in_fp8(honest_run: HonestRun, tiny_model_path: Path) -> None:
    """Certified above as the bytes the engines serve; here, that the bytes were FP8: the projections, most of this
    model, at one byte an element: a push carries under half the float32 model's bytes (the log rounds to 0.1 MB)."""
    from transformers import AutoModelForCausalLM

    assert honest_run.returncode == 0, honest_run.output[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    float32_mb = sum(tensor.numel() * 4 for tensor in model.parameters()) / 1e6
    pushed = [json.loads(line) for line in (honest_run.run_dir / "logs" / "learner.jsonl").read_text().splitlines()
              if '"weights pushed"' in line]
    assert pushed and all(entry["mb"] < float32_mb / 2 for entry in pushed), (float32_mb, pushed[:2])


@pytest.mark.system
@pytest.mark.timeout(300)
def test_rows_without_a_label_are_left_out_of_training_and_counted(honest_run: HonestRun) -> None:
    assert honest_run.returncode == 0, honest_run.output[-3000:]
    said = (f"skipped 10 of 100 records of {honest_run.data} as malformed, the first at line 1: "
            "label key 'label' missing")
    assert said in honest_run.output
    batches = [decode(path.read_bytes()) for path in sorted(honest_run.recorded.glob("batch_*.msgpack"))]
    samples = [sample for batch in batches for sample in batch.samples]
    assert len(samples) == HONEST_STEPS * HONEST_BATCH * 4
    assert all(sample.label is not None for sample in samples)
    assert not {sample.prompt for sample in samples} & honest_run.unlabelled
