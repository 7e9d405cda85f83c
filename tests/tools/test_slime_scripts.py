"""`python -m tools.slime_scripts SLIME_CHECKOUT`: each run script's command line captured by running it under bash
with nothing started, a tiny model of its family and stand-in files substituted, and the launcher's configuration,
preflight and the learner's model checks run on it.

slime's own repository is not here in CI; the checkout these tests build holds the captured scripts of
`tests/data/slime_scripts/` as its `scripts/run-*.sh` (their absolute /slime and /configs paths moved into it) and
one script written the way slime's scripts are (Ray, `pkill`, `nvidia-smi`, a sourced model-flag file, a line
without its `\\`), which tests the capture itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.slime_scripts import SCRIPTS
from tools.slime_checkout.capture import capture, export_checkout

SUPPORT = Path(__file__).resolve().parents[1] / "support"
SLIME_STYLE_PLUGIN = SUPPORT / "slime_imports_plugin.py"
STRANDS_PLUGIN = SUPPORT / "strands_generate.py"  # imports strands and strands_sglang: the strands extra

# A model-flag file as slime's scripts/models/*.sh are: a MODEL_ARGS array of Megatron's flags.
MODEL_FILE = """MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2560
   --num-attention-heads 32
   --qk-layernorm
)
"""
# slime's run scripts' way: clean up the machine, count GPUs, source the model, start Ray, submit train.py.
RAY_SCRIPT = """#!/bin/bash
pkill -9 sglang
ray stop --force
rm -rf /root/should-not-go
set -ex
NUM_GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/../scripts/models/qwen3-4B.sh"
CKPT_ARGS=(
   --hf-checkpoint /root/Qwen3-4B
   --save /root/Qwen3-4B_slime/
)
ROLLOUT_ARGS=(--prompt-data /root/dapo-math-17k.jsonl --input-key prompt --apply-chat-template)
ray start --head --num-gpus 8
ray job submit --address="http://127.0.0.1:8265" -- python3 train.py \\
   --actor-num-gpus-per-node 8 \\
   --update-weight-buffer-size $(( 4 * 512 * 1024 * 1024))
   ${MODEL_ARGS[@]} \\
   ${CKPT_ARGS[@]} \\
   ${ROLLOUT_ARGS[@]} \\
   --rollout-num-gpus $((NUM_GPUS + 8)) 2>&1 | tee /root/train.log
"""
EVAL_CONFIG = """eval:
  datasets:
    - name: aime
      path: /root/aime-2024/aime-2024.jsonl
      rm_type: deepscaler
      input_key: question
      label_key: answer
    - name: arith
      path: /root/arith.jsonl
      rm_type: exact_match
"""
ROLE_OVERRIDES = "megatron:\n  - role: actor\n    overrides:\n      lr: 1e-6\n"


def _checkout(root: Path) -> Path:
    (root / "scripts" / "models").mkdir(parents=True)
    (root / "scripts" / "models" / "qwen3-4B.sh").write_text(MODEL_FILE, encoding="utf-8")
    (root / "examples" / "ray_style").mkdir(parents=True)
    (root / "examples" / "ray_style" / "run.sh").write_text(RAY_SCRIPT, encoding="utf-8")
    (root / "examples" / "eval_multi_task").mkdir()
    (root / "examples" / "eval_multi_task" / "multi_task.yaml").write_text(EVAL_CONFIG, encoding="utf-8")
    (root / "configs").mkdir()
    (root / "configs" / "megatron_ppo.yaml").write_text(ROLE_OVERRIDES, encoding="utf-8")
    # slime's multi-agent generate, as its checkout has it: a module of its `examples` importing slime's modules
    (root / "examples" / "multi_agent").mkdir()
    (root / "examples" / "multi_agent" / "__init__.py").write_text("", encoding="utf-8")
    (root / "examples" / "multi_agent" / "rollout_with_multi_agents.py").write_text(
        SLIME_STYLE_PLUGIN.read_text(encoding="utf-8"), encoding="utf-8")
    # slime's strands generate, likewise: its Strands agent and strands-sglang model come from installed packages
    (root / "examples" / "strands_sglang").mkdir()
    (root / "examples" / "strands_sglang" / "__init__.py").write_text("", encoding="utf-8")
    (root / "examples" / "strands_sglang" / "generate_with_strands.py").write_text(
        STRANDS_PLUGIN.read_text(encoding="utf-8"), encoding="utf-8")
    for script in SCRIPTS.glob("*.sh"):
        text = script.read_text(encoding="utf-8").replace("/slime/", f"{root}/")
        text = text.replace("/configs/", f"{root}/configs/")
        (root / "scripts" / f"run-{script.name}").write_text(text, encoding="utf-8")
    return root


@pytest.mark.unit
def test_a_ray_script_is_captured_with_nothing_started(tmp_path: Path) -> None:
    checkout = export_checkout(_checkout(tmp_path / "source"), tmp_path / "export")
    captured = capture(checkout, Path("examples/ray_style/run.sh"), tmp_path / "sandbox")
    assert captured.entry == "train"
    # the line after `--update-weight-buffer-size` lost its `\`: bash ran the rest as a command of its own, which
    # the capture reads as slime meant it (and says so); $(( )) and $(nvidia-smi ... | wc -l) are bash's (0 GPUs)
    assert captured.argv == [
        "--actor-num-gpus-per-node", "8", "--update-weight-buffer-size", str(2 ** 31),
        "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--num-attention-heads", "32", "--qk-layernorm",
        "--hf-checkpoint", "/root/Qwen3-4B", "--save", "/root/Qwen3-4B_slime/", "--prompt-data",
        "/root/dapo-math-17k.jsonl", "--input-key", "prompt", "--apply-chat-template", "--rollout-num-gpus", "8"]
    # the model file is sourced from a folder where it is not (as slime's scripts/low_precision/ ones do): the
    # file of that name in scripts/models/ is read, and the note says so
    assert captured.notes == [
        "sources examples/scripts/models/qwen3-4B.sh, which is not in slime's tree: read scripts/models/qwen3-4B.sh",
        "its command line continues after a line without `\\` (--swiglu ...): read as one command line"]
    assert [Path(path).name for path in captured.sourced] == ["qwen3-4B.sh"]
    assert {"pkill", "ray", "rm", "nvidia-smi"} <= {command[0] for command in captured.commands}


@pytest.mark.integration
def test_the_captured_scripts_pass_or_fail_with_the_reason_in_the_table(tmp_path: Path,
                                                                        tiny_model_cache: Path) -> None:
    from tools.slime_scripts import check_checkout, markdown_table

    rows = {row.script: row for row in check_checkout(_checkout(tmp_path / "source"), tmp_path / "work",
                                                      cache=tiny_model_cache)}
    passed = {name for name, row in rows.items() if row.launcher == "ok"}
    # the multi-agent script's generate is the checkout's `examples.multi_agent...` (its root on the path, as
    # slime's scripts put it), and its `slime.*` imports are answered by ours
    assert passed == {f"scripts/run-{name}.sh" for name in (
        "dense-qwen3-4b-grpo", "eval-multi-task-qwen3-4b", "fully-async-qwen2.5-0.5b", "moe-qwen3-30b-a3b",
        "multi-agent-qwen3-30b-a3b", "opd-teacher-in-learner", "opd-teacher-server", "sft-qwen3-4b-base",
        "strands-qwen3-8b", "vlm-qwen3-vl-8b-fsdp")} | {
        "examples/ray_style/run.sh"}
    # a script written for --train-backend torch (its system test gives it): the reason names the backend; the
    # learner-held teacher's script runs on megatron as slime's does
    assert rows["scripts/run-opd-teacher-in-learner.sh"].learner == "ok"
    assert "--train-backend megatron has no value model" in rows["scripts/run-ppo-critic.sh"].launcher
    moe = rows["scripts/run-moe-qwen3-30b-a3b.sh"]
    assert moe.family == "qwen3_moe" and moe.learner.startswith("refused: --optimizer-cpu-offload True")
    assert rows["scripts/run-sft-qwen3-4b-base.sh"].learner == "ok"
    assert rows["scripts/run-vlm-qwen3-vl-8b-fsdp.sh"].family == "vlm"
    table = markdown_table(list(rows.values()))
    assert "11 of 12 scripts pass configuration and preflight" in table
    assert rows["scripts/run-strands-qwen3-8b.sh"].learner == "ok"
    assert not any(name.startswith(("examples.multi_agent", "examples.strands_sglang"))
                   for name in sys.modules)  # forgotten after its check
