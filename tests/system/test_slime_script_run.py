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


# The MoE script's model, parallelism and weight-transport flags describe Qwen3-30B-A3B on 8 GPUs; on CPU they
# describe the tiny Qwen3-MoE (the learner checks its Megatron model flags against the checkpoint) on one learner
# rank and one engine, and the weights go over the default transport (NCCL needs GPUs: preflight refuses it here).
TINY_MOE_FLAGS = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "176", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--kv-channels": "16", "--rotary-base": "10000", "--num-experts": "4",
    "--moe-router-topk": "2", "--moe-ffn-hidden-size": "176", "--vocab-size": "102", "--moe-layer-freq": "[1]*2",
    "--tensor-model-parallel-size": "1", "--expert-model-parallel-size": "1", "--actor-num-gpus-per-node": "1",
    "--rollout-num-gpus": "1", "--rollout-num-gpus-per-engine": "1",
    "--num-rollout": "3", "--rollout-batch-size": "4", "--n-samples-per-prompt": "2",
    "--rollout-max-response-len": "8", "--global-batch-size": "8", "--eval-max-response-len": "8",
    "--n-samples-per-eval-prompt": "1", "--max-tokens-per-gpu": "2048", "--eval-interval": "2",
}


def _tiny_moe_script(model: Path, tmp_path: Path, flags: dict[str, str]) -> tuple[str, list[str]]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {}}) + "\n"
                            for a in range(4) for b in range(4)), encoding="utf-8")
    entry, argv = read_slime_script(SCRIPTS / "moe-qwen3-30b-a3b.sh", overrides={"MODEL": str(model)})
    for flag, value in {**flags, "--prompt-data": str(data), "--save": str(tmp_path / "save")}.items():
        argv[argv.index(flag) + 1] = value
    argv[argv.index("--eval-prompt-data") + 2] = str(data)
    transport = argv.index("--update-weight-transport")
    del argv[transport : transport + 2]
    return entry, [*argv, "--custom-rm-path", "tests.support.reward_plugins:digit_share"]


@pytest.mark.system
def test_the_moe_slime_script_trains_a_tiny_qwen3_moe_on_cpu(tiny_model_cache: Path, tmp_path: Path) -> None:
    """slime's Qwen3-30B-A3B script (GSPO, dynamic sampling by slime's own filter, its MoE flags) with a tiny
    Qwen3-MoE; a reward that varies between an untrained model's samples, so dynamic sampling keeps groups."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    entry, argv = _tiny_moe_script(model, tmp_path, TINY_MOE_FLAGS)
    argv.remove("--sequence-parallel")
    completed, steps = run_slime_script(entry, argv, tmp_path / "run")
    assert len(steps) == 3
    assert "dropped: zero_std" in completed.stdout + completed.stderr  # slime's filter ran as ours


@pytest.mark.system
def test_the_moe_slime_script_trains_on_megatron_with_expert_parallelism_replaying_pi_olds_routes(
    tiny_model_cache: Path, tmp_path: Path
) -> None:
    """The same script on slime's own backend and engine: two learner ranks (gloo) splitting the experts (EP 2,
    expert TP 1 as the script sets it), weights pushed every step to an SGLang(-compatible) server, which loads
    experts under checkpoint names only. Its CPU-offloaded optimizer goes (the Megatron backend refuses it by
    name: it runs and checkpoints megatron's on-device Adam only).

    With --use-routing-replay (slime's R2) and --use-decoupled-ppo over two optimizer steps a batch (global batch
    4 of the batch's 8 samples): pi_old's forward records each token's experts on every rank, the batch's samples
    carry them into both optimizer steps (the second replays pi_old's routes, not the updated policy's own). The
    run is the one Megatron R2 run of the suite (tests/system/test_routing_replay_run.py runs R3)."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    flags = {**TINY_MOE_FLAGS, "--expert-model-parallel-size": "2", "--actor-num-gpus-per-node": "2",
             "--global-batch-size": "4"}
    entry, argv = _tiny_moe_script(model, tmp_path, flags)
    for offload in ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"):
        argv.remove(offload)
    argv += ["--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server",
             "--use-routing-replay", "--use-decoupled-ppo"]
    _, steps = run_slime_script(entry, argv, tmp_path / "run", train_backend="megatron")
    assert len(steps) == 3 and all(row["optimizer_steps"] == 2 for row in steps), steps
    assert all(row["grad_norm"] > 0 for row in steps), steps


def _geo3k_like_parquet(folder: Path) -> Path:
    """Geometry3K's shape: a `prompt` with an <image> mark, a LaTeX `label`, and `images` as Hugging Face image
    structs (PNG bytes) in train.parquet and test.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageDraw

    from engines.vision.images import encode_png

    def figure(apex: int) -> bytes:
        picture = Image.new("RGB", (56, 56), (255, 255, 255))
        ImageDraw.Draw(picture).polygon([(4, 50), (50, 50), (4 + apex, 6)], outline=(0, 0, 0))
        return encode_png(picture)

    answers = ["3\\sqrt{3}", "\\frac{40}{3}", "60", "4.5"]
    rows = {"prompt": [f"<image>Find x in triangle {i}. Put the answer in \\boxed{{}}." for i in range(8)],
            "label": [answers[i % 4] for i in range(8)],
            "images": [[{"bytes": figure(4 * i), "path": None}] for i in range(8)]}
    folder.mkdir(parents=True)
    pq.write_table(pa.table(rows), folder / "train.parquet")
    pq.write_table(pa.table({key: column[:2] for key, column in rows.items()}), folder / "test.parquet")
    return folder


@pytest.mark.system
def test_slimes_vlm_fsdp_script_trains_a_tiny_vlm_colocated_on_cpu(tiny_vlm_path: Path, tmp_path: Path) -> None:
    """slime's Qwen3-VL script (FSDP backend, geo3k reward, images by --multimodal-keys, --colocate, eval top-p)
    with the tiny Qwen2.5-VL and geo3k-shaped pictures, sized to two steps and one learner rank: FSDP runs as our
    torch backend with gradient checkpointing, the geo3k reward scores (its extras are logged), the eval rounds
    generate from the held-out pictures."""
    data = _geo3k_like_parquet(tmp_path / "geo3k")
    entry, argv = read_slime_script(SCRIPTS / "vlm-qwen3-vl-8b-fsdp.sh",
                                    overrides={"MODEL": str(tiny_vlm_path), "DATA": str(data)})
    for flag, value in {"--num-rollout": "2", "--rollout-batch-size": "2", "--n-samples-per-prompt": "2",
                        "--rollout-max-response-len": "8", "--global-batch-size": "4", "--eval-interval": "2",
                        "--eval-max-response-len": "8", "--actor-num-gpus-per-node": "1"}.items():
        argv[argv.index(flag) + 1] = value
    completed, steps = run_slime_script(entry, argv, tmp_path / "run")
    assert "--attn-implementation (the torch trainer" in completed.stderr
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert {"reward/correct", "reward/format_ok"} <= row.keys() and row["dropped/bad_images"] == 0, row
    rounds = [json.loads(line) for line in (tmp_path / "run" / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rounds] == [0, 2]
    assert all(row["eval/geo3k-test/failed_samples"] == 0 and "eval/geo3k-test/reward/correct" in row
               for row in rounds)
