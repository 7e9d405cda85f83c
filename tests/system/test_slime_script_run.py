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

import numpy as np
import pytest

from bus.codec import decode
from bus.episodes import by_episode
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


def _tiny_moe_script(model: Path, tmp_path: Path, flags: dict[str, str], script: str = "moe-qwen3-30b-a3b.sh"
                     ) -> tuple[str, list[str]]:
    """A Qwen3-30B-A3B script's argv with the tiny Qwen3-MoE, `flags` (those the script sets) and a small prompt
    file; its NCCL transport dropped and a reward that varies between an untrained model's samples added."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {}}) + "\n"
                            for a in range(4) for b in range(4)), encoding="utf-8")
    entry, argv = read_slime_script(SCRIPTS / script, overrides={"MODEL": str(model)})
    for flag, value in {**flags, "--prompt-data": str(data), "--save": str(tmp_path / "save")}.items():
        argv[argv.index(flag) + 1] = value
    if "--eval-prompt-data" in argv:
        argv[argv.index("--eval-prompt-data") + 2] = str(data)
    if "--update-weight-transport" in argv:
        transport = argv.index("--update-weight-transport")
        del argv[transport : transport + 2]
    return entry, [*argv, "--custom-rm-path", "tests.support.reward_plugins:digit_share"]


@pytest.mark.system
def test_the_moe_slime_script_trains_a_tiny_qwen3_moe_on_cpu(tiny_model_cache: Path, tmp_path: Path) -> None:
    """slime's Qwen3-30B-A3B script (GSPO, dynamic sampling by slime's own filter, its MoE flags) with a tiny
    Qwen3-MoE; a reward that varies between an untrained model's samples, so dynamic sampling keeps groups. With
    the MTP flags of slime's GLM-4.7-30B-A3B script (the same MoE shape): a MoE MTP layer trains beside the policy
    and every checkpoint keeps it."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    entry, argv = _tiny_moe_script(model, tmp_path, TINY_MOE_FLAGS)
    argv.remove("--sequence-parallel")
    argv += ["--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2"]
    completed, steps = run_slime_script(entry, argv, tmp_path / "run")
    assert len(steps) == 3
    assert "dropped: zero_std" in completed.stdout + completed.stderr  # slime's filter ran as ours
    assert all(row["mtp_loss"] == row["mtp_1_loss"] > 0 for row in steps), steps
    assert list((tmp_path / "save").rglob("mtp.safetensors"))


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


@pytest.mark.system
def test_the_multi_agent_slime_script_trains_each_agents_sample_against_the_engines_log_probs(
    tiny_model_cache: Path, tmp_path: Path
) -> None:
    """slime's multi-agent script (colocated, GRPO, --use-rollout-logprobs) with a tiny Qwen3-MoE and our own
    slime-style multi-agent generate in place of slime's (written against slime's modules): each call's three agent
    samples (two solvers, a judge) are one episode of three segments that share the judge's reward, every one
    trained with the engine's log-probs as pi_old (the loss saw no difference between the two, token by token)."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    flags = {flag: value for flag, value in TINY_MOE_FLAGS.items() if flag not in (
        "--rollout-num-gpus", "--eval-max-response-len", "--eval-interval", "--n-samples-per-eval-prompt")}
    flags.update({"--num-rollout": "2", "--rollout-batch-size": "2", "--global-batch-size": "4",
                  "--rollout-max-context-len": "160",
                  "--custom-generate-function-path": "examples.slime_style.multi_agent:generate"})
    entry, argv = _tiny_moe_script(model, tmp_path, flags, script="multi-agent-qwen3-30b-a3b.sh")
    argv.remove("--sequence-parallel")
    debug = tmp_path / "batches"
    argv += ["--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server",
             "--save-debug-rollout-data", str(debug)]
    _, steps = run_slime_script(entry, argv, tmp_path / "run")
    assert len(steps) == 2
    for row in steps:  # pi_old minus mu on every trained token: exactly 0 only when pi_old is mu
        assert row["train_rollout_logprob_abs_diff"] == 0.0 and row["is_weight_abs_dev"] == 0.0, row
    batches = sorted(debug.glob("batch_*.msgpack"))
    assert len(batches) == 2
    for path in batches:
        samples = decode(path.read_bytes()).samples
        episodes = by_episode(samples)
        assert len(episodes) == 4 and len(samples) == 12
        for segments in episodes.values():
            assert [s.segment for s in segments] == [0, 1, 2] and [s.ends_episode for s in segments] == [0, 0, 1]
            assert segments[2].prompt[0]["content"].count("Answer ") == 2  # the judge read both solvers
            assert len({s.reward for s in segments}) == 1 and segments[0].reward is not None
            for sample in segments:
                assert len(sample.rollout_log_probs) == sample.response_length > 0
                assert np.all(sample.rollout_log_probs < 0)


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


# slime's SFT script describes Qwen3-4B-Base on 8 GPUs; on CPU the tiny Qwen3 (its Megatron shape flags set to the
# tiny model's) on one learner rank, with batches of 4 conversations so that three epochs of 16 are 12 batches.
TINY_QWEN3_SFT_FLAGS = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "176", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--kv-channels": "16", "--rotary-base": "10000", "--vocab-size": "102",
    "--actor-num-gpus-per-node": "1", "--rollout-batch-size": "4", "--global-batch-size": "4", "--lr": "1e-3",
}


@pytest.mark.system
def test_the_sft_slime_script_trains_a_tiny_qwen3_on_whole_conversations_and_its_loss_falls(
    tiny_model_cache: Path, tmp_path: Path
) -> None:
    """slime's SFT script as it is (its rollout function, --num-epoch 3, --loss-type sft_loss, no advantages, no
    engine), the data two-round conversations: 3 epochs of 16 conversations in batches of 4 are 12 steps, each
    trained on exactly the assistant messages' tokens (qwen's mask: the text, <|im_end|> and the newline), and the
    loss falls."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3"))
    data = tmp_path / "chats.jsonl"
    chats = [[{"role": "system", "content": "Answer with the number."}, {"role": "user", "content": f"{a}+{b}="},
              {"role": "assistant", "content": str(a + b)}, {"role": "user", "content": "times?"},
              {"role": "assistant", "content": str(a * b)}] for a in range(4) for b in range(4)]
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats), encoding="utf-8")
    entry, argv = read_slime_script(SCRIPTS / "sft-qwen3-4b-base.sh", overrides={"MODEL": str(model),
                                                                                 "DATA": str(data)})
    for flag, value in {**TINY_QWEN3_SFT_FLAGS, "--save": str(tmp_path / "save"),
                        "--load": str(tmp_path / "save")}.items():
        argv[argv.index(flag) + 1] = value
    argv.remove("--sequence-parallel")
    completed, steps = run_slime_script(entry, argv, tmp_path / "run")
    assert "--debug-train-only (slime's SFT starts no engines" in completed.stderr
    assert len(steps) == 12
    trained = {len(chat[2]["content"]) + len(chat[4]["content"]) + 4 for chat in chats}  # 2 x (<|im_end|>, "\n")
    assert all(min(trained) * 4 <= row["loss_tokens"] <= max(trained) * 4 for row in steps), steps
    assert sum(row["loss"] for row in steps[-3:]) < 0.9 * sum(row["loss"] for row in steps[:3]), steps


EVAL_CONFIG = """eval:
  defaults:
    max_response_len: 6
    top_p: 0.7
  datasets:
    - name: aime
      path: {folder}/aime.jsonl
      rm_type: deepscaler
      input_key: question
      label_key: answer
      n_samples_per_eval_prompt: 4
      temperature: 1.0
    - name: arith
      path: {folder}/arith.jsonl
      rm_type: exact_match
      n_samples_per_eval_prompt: 1
      min_new_tokens: 5
"""


@pytest.mark.system
def test_the_multi_task_eval_slime_script_evaluates_each_dataset_by_its_own_settings(
    tiny_model_cache: Path, tmp_path: Path
) -> None:
    """slime's multi-task eval example (train.py, colocated, --eval-config) with a tiny Qwen3 and two datasets of
    their own keys, sample counts and rewards: each is evaluated before training and after step 2, its pass@k by its
    own sample count, and only the deepscaler set reports deepscaler's reward fields."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3"))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)), encoding="utf-8")
    (tmp_path / "aime.jsonl").write_text("".join(json.dumps({"question": f"{a}*3=", "answer": str(a * 3)}) + "\n"
                                                 for a in range(3)), encoding="utf-8")
    (tmp_path / "arith.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1)}) + "\n"
                                                  for a in range(5)), encoding="utf-8")
    config = tmp_path / "multi_task.yaml"
    config.write_text(EVAL_CONFIG.format(folder=tmp_path), encoding="utf-8")
    entry, argv = read_slime_script(SCRIPTS / "eval-multi-task-qwen3-4b.sh",
                                    overrides={"MODEL": str(model), "EVAL_CONFIG_PATH": str(config)})
    flags = {**TINY_QWEN3_SFT_FLAGS, "--tensor-model-parallel-size": "1", "--rollout-num-gpus-per-engine": "1",
             "--num-rollout": "2", "--rollout-batch-size": "2", "--n-samples-per-prompt": "2",
             "--global-batch-size": "4", "--rollout-max-response-len": "6", "--eval-interval": "2",
             "--prompt-data": str(data), "--save": str(tmp_path / "save"), "--load": str(tmp_path / "save")}
    for flag, value in flags.items():
        argv[argv.index(flag) + 1] = value
    argv.remove("--sequence-parallel")
    memory = argv.index("--sglang-mem-fraction-static")
    del argv[memory : memory + 2]
    _, steps = run_slime_script(entry, argv, tmp_path / "run")
    assert len(steps) == 2
    rounds = [json.loads(line) for line in (tmp_path / "run" / "metrics" / "eval.jsonl").read_text().splitlines()]
    by_set = {(row["step"], next(key.split("/")[1] for key in row if key.startswith("eval/"))): row for row in rounds}
    assert sorted(by_set) == [(0, "aime"), (0, "arith"), (2, "aime"), (2, "arith")]
    for step in (0, 2):
        aime, arith = by_set[(step, "aime")], by_set[(step, "arith")]
        assert "eval/aime/pass@4" in aime and "eval/arith/pass@1" in arith
        assert "eval/aime/reward/format_ok" in aime and not any("/reward/" in key for key in arith)
        assert aime["eval/aime/failed_samples"] == arith["eval/arith/failed_samples"] == 0
