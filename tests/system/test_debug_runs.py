"""Debug modes through launcher.py: record rollouts without training, then train on a recording alone.

This is how a user separates "is generation right?" from "is training right?": a training-only run must train on
exactly the batches a run recorded, with no rollout worker or reward worker running. The recording it replays is a
fully-async run's, whose training depended on timing (which weights generated a group) and is not repeatable; the
replay must be: the same losses and the same model, bit for bit. The rollout-only run also checks that the run
waits for the final version's eval round instead of cutting it off. slime's forge replay
(its rollout dumps trained on while the engines stay up) is the same replay with engines.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from bus.codec import decode
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
COMMON = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
          "--no-progress", "--no-use-tensorboard", "--no-plots", "--heartbeat-interval", "0.25"]
# The tiny untrained model earns no reward, so GRPO advantages would be zero and nothing would move; an SFT loss
# on the recorded responses always has a gradient, which is what the comparison of the two learners needs.
SFT_ON_RECORDING = ["--loss-type", "sft", "--lr", "1e-3"]
WANDB_OFFLINE = ["--use-wandb", "--wandb-mode", "offline"] if importlib.util.find_spec("wandb") else []


# On the CPU everywhere: the two-rank learner below needs two GPUs on a GPU machine (one showed it failing with
# one GPU), and the parity of one and two ranks is a gloo property. The GPU placement has tests of its own.
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run(arguments: list[str], timeout: float = 180) -> None:
    completed = subprocess.run([sys.executable, str(REPO / "launcher.py"), "--head", *arguments, *COMMON],
                               cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False, env=CPU_ONLY)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(row["batch_id"], row["loss"], row["grad_norm"]) for row in jsonl(run_dir / "metrics" / "train.jsonl")]


@pytest.mark.system
def test_recorded_rollouts_replay_into_a_training_only_run(tiny_model_path: Path, tmp_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=5, eval_size=6, sft_size=4)
    recording = tmp_path / "recording"
    rollout_run = tmp_path / "rollout-only"
    run(["--run-dir", str(rollout_run), "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(data["train"]),
         "--num-rollout", "3", "--debug-rollout-only", "--save-debug-rollout-data", str(recording),
         "--eval-prompt-data", "heldout", str(data["eval"]), "--eval-interval", "100"])

    assert sorted(path.name for path in recording.glob("batch_*.msgpack")) == [f"batch_00000{i}.msgpack"
                                                                                  for i in (1, 2, 3)]
    assert not (rollout_run / "final_model").exists(), "a rollout-only run must not train or export a model"
    eval_versions = sorted(row["step"] for row in jsonl(rollout_run / "metrics" / "eval.jsonl"))
    assert eval_versions == [0, 3], "the baseline and the final version are evaluated even off the interval"

    # A fully-async run that trains (SFT on its own responses, as the replays below) and records its batches.
    recording = tmp_path / "async-recording"
    async_run = tmp_path / "async"
    run(["--run-dir", str(async_run), "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(data["train"]),
         "--num-rollout", "3", "--rollout-workers", "2", "--max-staleness", "2", "--save-debug-rollout-data",
         str(recording), *SFT_ON_RECORDING])
    recorded = {int(path.stem.split("_")[1]): decode(path.read_bytes()) for path in recording.glob("batch_*.msgpack")}
    assert sorted(recorded) == [1, 2, 3]

    train_run = tmp_path / "train-only"
    # slime's logging and export flags ride along: an HF export at each checkpoint, a rollout log hook reading its
    # setting from the custom config, the multi-turn and correct-sample metrics, a named W&B run.
    custom = tmp_path / "custom.yaml"
    custom.write_text(f"hook_log: {tmp_path / 'hook.jsonl'}\n", encoding="utf-8")
    slime_logging = ["--save-interval", "2", "--save-hf", str(tmp_path / "hf" / "iter_{rollout_id}"),
                     "--custom-rollout-log-function-path", "tests.support.slime_log_hooks.log_rollout",
                     "--custom-config-path", str(custom), "--log-multi-turn", "--log-correct-samples"]
    named_wandb = ["--wandb-run-id", "slime-debug-7"] if WANDB_OFFLINE else []
    run(["--run-dir", str(train_run), "--hf-checkpoint", str(tiny_model_path), "--num-rollout", "3",
         "--debug-train-only", "--load-debug-rollout-data", str(recording), "--rollout-workers", "0",
         "--reward-workers", "0", *SFT_ON_RECORDING, *WANDB_OFFLINE, *named_wandb, *slime_logging])

    trained = {row["batch_id"]: row["sample_ids"] for row in jsonl(train_run / "metrics" / "trained_samples.jsonl")}
    assert trained == {batch_id: [s.sample_id for s in batch.samples] for batch_id, batch in recorded.items()}
    assert [row["version"] for row in jsonl(train_run / "metrics" / "train.jsonl")] == [1, 2, 3]
    assert losses(train_run) == losses(async_run)  # bit for bit, not approximately
    assert ((train_run / "final_model" / "model.safetensors").read_bytes()
            == (async_run / "final_model" / "model.safetensors").read_bytes())
    launched = (train_run / "logs" / "launcher-0.jsonl").read_text(encoding="utf-8")
    assert "rollout-0-0" not in launched and "reward-0-0" not in launched
    assert "actor crashed" not in launched  # no buffer without prompts
    if WANDB_OFFLINE:  # the controller mirrored the learner's metrics into an offline W&B run
        mirrored = b"".join(path.read_bytes() for path in (train_run / "wandb").rglob("*.wandb"))
        assert b"train/loss" in mirrored and b"train/step" in mirrored
        assert [path.name for path in (train_run / "wandb").rglob("*.wandb")] == ["run-slime-debug-7.wandb"]
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == ["iter_1", "iter_2"]  # batches 2 and 3
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "iter_2")
    final = load_file(str(train_run / "final_model" / "model.safetensors"))
    for name, tensor in exported.state_dict().items():
        if name in final:
            torch.testing.assert_close(tensor, final[name], msg=name)  # the last export is the final model
    hooked = jsonl(tmp_path / "hook.jsonl")
    assert [row["rollout_id"] for row in hooked] == [0, 1, 2]
    assert all(row["samples"] == 4 and "rollout/reward_mean" in row["metrics"] for row in hooked)
    rows = jsonl(train_run / "metrics" / "train.jsonl")
    assert [row["rollout/hook_saw_samples"] for row in rows] == [4, 4, 4]  # what the hook added is logged too
    assert all("multi_turn/wo_obs_response_length/response_length_mean" in row
               and "rollout/correct_length/p100" in row for row in rows)

    # The same recording on a two-process learner, each row split across the two ranks (context parallelism): both
    # train every group, each on its half of every row, and the model is the single process's. (Two ranks that
    # split the groups instead: tests/engines/test_trainer_ddp.py, and a learner on two nodes,
    # tests/system/test_multinode_learner.py.)
    one = load_file(str(train_run / "final_model" / "model.safetensors"))
    assert not torch.equal(one["model.embed_tokens.weight"],
                           load_file(str(tiny_model_path / "model.safetensors"))["model.embed_tokens.weight"])
    split_rows = tmp_path / "train-context-parallel"
    run(["--run-dir", str(split_rows), "--hf-checkpoint", str(tiny_model_path), "--num-rollout", "3",
         "--debug-train-only", "--load-debug-rollout-data", str(recording), "--rollout-workers", "0",
         "--reward-workers", "0", "--learner-ranks", "2", "--context-parallel-size", "2", *SFT_ON_RECORDING])
    ready = (split_rows / "logs" / "learner-rank-1.log").read_text(encoding="utf-8")
    assert "learner rank 1/2 ready, data-parallel rank 0/1" in ready  # one replica: the two ranks split its rows
    split = load_file(str(split_rows / "final_model" / "model.safetensors"))
    assert one.keys() == split.keys()
    for name in one:
        torch.testing.assert_close(split[name], one[name], rtol=1e-4, atol=1e-5, msg=name)


def dumped_sample(index: int, group_index: int, reward: float) -> dict[str, object]:
    """A sample as slime's `Sample.to_dict()` writes it into a rollout dump (the fields a replay reads, and two of
    the counters it leaves out)."""
    return {"group_index": group_index, "index": index, "prompt": f"{group_index}+1=", "tokens": [40, 41, 42, 43, 44],
            "response": "xyz", "response_length": 3, "label": "1", "reward": reward, "loss_mask": None,
            "rollout_log_probs": [-1.0, -1.0, -1.0], "remove_sample": False, "status": "completed", "metadata": {},
            "spec_info": {}, "prefix_cache_info": {}}


@pytest.mark.system
def test_slimes_forge_replay_trains_on_its_dumps_while_the_engines_take_its_pushes(tiny_model_path: Path,
                                                                                  tmp_path: Path) -> None:
    """slime's forge pair as a slime script gives it: the learner trains on the dump (batch 2 has no 1.pt, so 0.pt
    again), no buffer runs, and the rollout worker's engine stays up and takes the pushes, fingerprints matched."""
    torch.save({"rollout_id": 0, "samples": [dumped_sample(0, 0, 1.0), dumped_sample(1, 0, 0.0),
                                             dumped_sample(2, 1, 0.0), dumped_sample(3, 1, 1.0)]}, tmp_path / "0.pt")
    forged = tmp_path / "forged"
    run(["--run-dir", str(forged), "--hf-checkpoint", str(tiny_model_path), "--num-rollout", "2",
         "--rollout-function-path", "slime.rollout.forge_load.generate_rollout",
         "--load-forge-rollout-data", str(tmp_path / "{rollout_id}.pt"), "--rollout-workers", "1",
         "--reward-workers", "0"])
    trained = {row["batch_id"]: row["sample_ids"] for row in jsonl(forged / "metrics" / "trained_samples.jsonl")}
    assert trained == {b: [f"forge-{b}-{g}/{i}" for g in (0, 1) for i in (0, 1)] for b in (1, 2)}
    assert [row["version"] for row in jsonl(forged / "metrics" / "train.jsonl")] == [1, 2]
    checks = jsonl(forged / "metrics" / "weight_checks.jsonl")
    # Pushes go to live engines only. The dump needs no generation, so the two steps may be over before the rollout
    # worker has loaded its engine (CI43: it registered after the run ended); once it is up when the last step's
    # checkpoint is written, the final weights are pushed to it and checked. Version 1's push runs beside batch 2's
    # step and gives way to version 2 when that step reads the weights first (publish(beside_training=True)), so it
    # is not required.
    worker_up = [row["timestamp"] for row in jsonl(forged / "logs" / "rollout-0-0.jsonl")
                 if row.get("event") == "registered"]
    last_saved = [row["timestamp"] for row in jsonl(forged / "logs" / "learner.jsonl")
                  if row.get("event") == "checkpoint saved" and row.get("version") == 2]
    if worker_up and worker_up[0] < last_saved[0]:
        assert 2 in {row["version"] for row in checks}
    assert all(row["matched"] == ["rollout-0-0"] and not row["differ"] for row in checks)
    assert not (forged / "buffer").exists()
