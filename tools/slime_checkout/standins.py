"""A captured slime command line made runnable here: a tiny model of the script's family for its model flags and
checkpoints, small stand-in files for its data, its GPU counts and parallel sizes at one.

What is substituted, and why (everything else on the command line stays as slime's script has it):
- the model: slime describes it twice, as Megatron flags (`MODEL_ARGS` of `scripts/models/*.sh`) and as the
  checkpoint it loads. Every flag any model-flag file sets is dropped and the tiny model's own flags appended, so
  the model checks compare a real checkpoint with flags that describe it;
- checkpoints (`--hf-checkpoint`, `--ref-load`, a critic's, an OPD teacher's) become the tiny model's folder, the
  folders written (`--save`, debug dumps) the sandbox's;
- data (`--prompt-data`, `--eval-prompt-data`, each dataset of `--eval-config`) become a few rows holding the keys
  the script reads (its `--input-key`, `--label-key`, `--metadata-key`, `--tool-key`);
- a relative path of a file in slime's checkout becomes absolute (slime's scripts run from its root);
- GPU counts and parallel sizes become 1: a tiny model's 4 heads split over no tensor-parallel 8, and this
  machine has no 8 GPUs. `--update-weight-transport nccl` goes with them (NCCL needs GPUs; preflight says so).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# A slime model-flag file's name (or a checkpoint's) -> the Hugging Face family it describes, first match wins.
FAMILY_PATTERNS = (
    (r"-vl|vl-|_vl", "vlm"), (r"qwen3[.-]?next", "qwen3_next"), (r"qwen3\.[56]|qwen3[56]", "qwen3_5"),
    (r"qwen3-.*a\d+b", "qwen3_moe"), (r"qwen3", "qwen3"), (r"qwen2\.5|qwen2", "qwen2"), (r"llama", "llama"),
    (r"glm-?4\.[57]", "glm4_moe"), (r"glm-?5", "glm_moe_dsa"), (r"glm-?4", "glm4"),
    (r"deepseek|kimi|moonlight", "deepseek_v3"), (r"minimax", "minimax_m2"), (r"mimo", "mimo"),
)
# Families with a tiny builder here (tools/standins), and the stand-in for each family without one.
BUILT = {"qwen2", "qwen3", "qwen3_moe", "llama", "vlm"}
MIXTURES = {"qwen3_moe", "qwen3_next", "qwen3_5", "glm4_moe", "glm_moe_dsa", "deepseek_v3", "minimax_m2"}
ONE = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
       "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--actor-num-nodes",
       "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine", "--critic-num-nodes",
       "--critic-num-gpus-per-node", "--num-gpus-per-node", "--sglang-dp-size", "--sglang-ep-size",
       "--sglang-tp-size", "--sglang-pp-size", "--prefill-num-servers")
DROPPED_ON_CPU = {"--update-weight-transport": "nccl"}
MODEL_FOLDERS = ("--hf-checkpoint", "--ref-load", "--critic-load", "--opd-teacher-load")
WRITTEN = {"--save": "save", "--critic-save": "critic-save", "--save-hf": "hf/{rollout_id}",
           "--save-debug-rollout-data": "debug/{rollout_id}.pt", "--dump-details": "details",
           "--tensorboard-dir": "tensorboard", "--load": "save"}


@dataclass
class Substituted:
    """The runnable command line and what was changed to make it, in words for the script's row."""

    argv: list[str]
    family: str
    model: Path
    notes: list[str] = field(default_factory=list)


def family_of(sourced: list[str], argv: list[str]) -> str | None:
    """The model family: of the first model-flag file the script sourced, else of its --hf-checkpoint's name."""
    names = [Path(path).stem for path in sourced] + [Path(v).name for v in values(argv, "--hf-checkpoint")]
    for name in names:
        for pattern, family in FAMILY_PATTERNS:
            if re.search(pattern, name.lower()):
                return family
    return None


# Set by a model-flag file but what the run trains, not a description of the checkpoint: kept with the tiny model.
TRAINED_NOT_DESCRIBED = {"--mtp-num-layers"}


def model_flags(checkout: Path) -> set[str]:
    """Every flag a model-flag file of slime's checkout sets (scripts/models/*.sh): the model's description."""
    flags: set[str] = set()
    for path in (checkout / "scripts" / "models").glob("*.sh"):
        flags.update(re.findall(r"^\s*(--[a-z0-9][a-z0-9-]*)", path.read_text(encoding="utf-8"), re.MULTILINE))
    return flags - TRAINED_NOT_DESCRIBED


def tiny_flags(hf_config: Any) -> list[str]:
    """The Megatron flags that describe a tiny model (its text config for a VLM), as slime's model files spell
    them: what `engines.megatron.model_flags.check_against_hf` compares, and nothing else."""
    text = hf_config.get_text_config()
    family = text.model_type
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    rope = dict(getattr(text, "rope_parameters", None) or {})
    flags = ["--num-layers", text.num_hidden_layers, "--hidden-size", text.hidden_size,
             "--ffn-hidden-size", text.intermediate_size, "--num-attention-heads", heads,
             "--group-query-attention", "--num-query-groups", text.num_key_value_heads, "--kv-channels", head_dim,
             "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", text.rms_norm_eps,
             "--use-rotary-position-embeddings", "--rotary-base", rope.get("rope_theta", 10000.0),
             "--vocab-size", text.vocab_size, "--disable-bias-linear"]
    if family.startswith("qwen2"):
        flags.append("--add-qkv-bias")
    if family.startswith("qwen3") and not family.startswith("qwen3_vl"):
        flags.append("--qk-layernorm")
    if not getattr(hf_config, "tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    if (experts := getattr(text, "num_experts", None)) is not None:
        flags += ["--num-experts", experts, "--moe-router-topk", text.num_experts_per_tok,
                  "--moe-ffn-hidden-size", text.moe_intermediate_size]
    return [str(token) for token in flags]


def tiny_model(family: str, cache: Path) -> tuple[Path, str]:
    """(the tiny model's folder, what it stands in as): the family's own where tools/standins builds it, else a
    tiny Qwen3 (dense) or Qwen3-MoE (a mixture-of-experts family)."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model
    from tools.standins.tiny_vlm import TinyVlmSpec, cached_tiny_vlm

    if family == "vlm":
        return cached_tiny_vlm(cache, TinyVlmSpec(family="qwen3_vl")), "qwen3_vl"
    built = family if family in BUILT else "qwen3_moe" if family in MIXTURES else "qwen3"
    return cached_tiny_model(cache, TinyModelSpec(family=built)), built


def values(argv: list[str], flag: str) -> list[str]:
    """The values given to `flag` (all of its tokens up to the next flag), [] when absent."""
    if flag not in argv:
        return []
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


def drop(argv: list[str], flag: str, arity: int | None) -> list[str]:
    """`argv` without every `flag` and its values (`arity` tokens; None: up to the next flag)."""
    kept, index = [], 0
    while index < len(argv):
        if argv[index] != flag:
            kept.append(argv[index])
            index += 1
            continue
        index += 1
        if arity is None:
            while index < len(argv) and not argv[index].startswith("--"):
                index += 1
        else:
            index += arity
    return kept


def put(argv: list[str], flag: str, *new: str) -> list[str]:
    """`argv` with `flag`'s value(s) replaced by `new`, where the flag is given."""
    if flag not in argv:
        return argv
    start = argv.index(flag) + 1
    return [*argv[:start], *new, *argv[start + len(values(argv, flag)):]]


def data_rows(argv: list[str], input_key: str | None = None, label_key: str | None = None) -> list[dict[str, Any]]:
    """Records holding what the script reads of each, one batch of them (`--num-epoch` wants a whole batch): a chat
    (a list of messages) where it applies a chat template or trains on messages, a text prompt otherwise."""
    key = input_key or (values(argv, "--input-key") or ["input"])[0]
    label = label_key or (values(argv, "--label-key") or ["label"])[0]
    chat = "--apply-chat-template" in argv or key == "messages"
    rows = []
    for a in range(max([4, *(int(v) for v in values(argv, "--rollout-batch-size")[:1])])):
        question = f"{a}+1="
        row: dict[str, Any] = {key: [{"role": "user", "content": question}] if chat else question, label: str(a + 1)}
        if key == "messages" or "--loss-mask-type" in argv:
            row[key] = [{"role": "user", "content": question}, {"role": "assistant", "content": str(a + 1)}]
        for extra, value in (("--metadata-key", {}), ("--tool-key", [])):
            for name in values(argv, extra)[:1]:
                row[name] = value
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def substitute(argv: list[str], family: str | None, *, checkout: Path, sandbox: Path, cache: Path,
               arities: dict[str, int | None]) -> Substituted:
    """The command line with the tiny model, stand-in files and one-device sizes (the module's docstring)."""
    from transformers import AutoConfig

    family = family or "qwen3"
    model, built = tiny_model(family, cache)
    notes = [] if family in BUILT else [f"no tiny {family} is built here: a tiny {built} stands in"]
    for flag in sorted(model_flags(checkout) & set(argv)):
        argv = drop(argv, flag, arities.get(flag))
    argv = [*argv, *tiny_flags(AutoConfig.from_pretrained(model))]
    argv = [str(checkout / token) if _checkout_path(checkout, token) else token for token in argv]
    for flag in MODEL_FOLDERS:
        argv = put(argv, flag, str(model))
    for flag, name in WRITTEN.items():
        if values(argv, flag):
            argv = put(argv, flag, str(sandbox / name))
    for flag in ONE:
        if values(argv, flag):
            argv = put(argv, flag, "1")
    for flag, value in DROPPED_ON_CPU.items():
        if values(argv, flag) == [value]:
            argv = drop(argv, flag, 1)
            notes.append(f"{flag} {value} dropped (needs GPUs)")
    if values(argv, "--prompt-data"):
        argv = put(argv, "--prompt-data", str(write_rows(sandbox / "data" / "train.jsonl", data_rows(argv))))
    eval_sets = values(argv, "--eval-prompt-data")
    if eval_sets:
        eval_rows = data_rows(argv, *(values(argv, "--eval-input-key")[:1] or [None]),
                              *(values(argv, "--eval-label-key")[:1] or [None]))
        pairs = [(name, str(write_rows(sandbox / "data" / f"eval-{name}.jsonl", eval_rows)))
                 for name in eval_sets[::2]]
        argv = put(argv, "--eval-prompt-data", *(token for pair in pairs for token in pair))
    if values(argv, "--eval-config") and Path(values(argv, "--eval-config")[0]).is_file():  # else preflight says
        argv = put(argv, "--eval-config", str(_eval_config(Path(values(argv, "--eval-config")[0]), argv, sandbox)))
    return Substituted(argv=argv, family=family, model=model, notes=notes)


def _checkout_path(checkout: Path, token: str) -> bool:
    """A relative path of a file in slime's checkout (`--custom-config-path examples/x/mis.yaml`): slime's scripts
    run from the checkout's root."""
    return "/" in token and not token.startswith(("/", "-")) and (checkout / token).is_file()


def _eval_config(path: Path, argv: list[str], sandbox: Path) -> Path:
    """slime's --eval-config with each dataset's path a stand-in file of the keys that dataset reads."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    for dataset in config.get("eval", {}).get("datasets", []):
        rows = data_rows(argv, dataset.get("input_key"), dataset.get("label_key"))
        dataset["path"] = str(write_rows(sandbox / "data" / f"eval-{dataset['name']}.jsonl", rows))
    target = sandbox / "eval_config.yaml"
    target.write_text(yaml.safe_dump(config), encoding="utf-8")
    return target
