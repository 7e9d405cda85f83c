"""The models benchmarks run on, by name: the demo's tiny model, a real pretrained one, and a real shape.

- `tiny`: the CPU demo's tiny Qwen2-style model (character vocabulary of ~106 tokens).
- `smollm2`: SmolLM2-135M-Instruct, the pretrained model this machine can get (`engines.pretrained`): 30 layers,
  576 hidden, a 49,152-token BPE vocabulary, tied embeddings.
- `qwen2.5-0.5b`: Qwen2.5-0.5B's shape with random weights (24 layers, 896 hidden, 14/2 heads, a 151,936-token
  vocabulary, tied embeddings): what the head and the KV cache cost at a production vocabulary. Its folder carries
  the character tokenizer, so text prompts tokenize; benchmarks that need no text feed it token ids.

Each is an HF folder under `.cache/models`, built or fetched once.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_NAMES = ("tiny", "smollm2", "qwen2.5-0.5b")
QWEN25_05B_SHAPE = {
    "vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32_768, "rope_theta": 1e6,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}


def bench_model(name: str, cache_dir: Path = REPO / ".cache") -> Path:
    """The HF folder of benchmark model `name` (one of MODEL_NAMES), built or fetched on first use."""
    if name == "tiny":
        from tools.demo import MODEL_SPEC
        from tools.standins.tiny_model import cached_tiny_model

        return cached_tiny_model(cache_dir / "models", MODEL_SPEC)
    if name == "smollm2":
        from engines.pretrained import SMOLLM2, cached_pretrained

        return cached_pretrained(SMOLLM2, cache_dir)
    if name == "qwen2.5-0.5b":
        return _random_qwen25_05b(cache_dir / "models" / "qwen2.5-0.5b-shape")
    raise ValueError(f"benchmark model {name!r} unknown; choose one of {', '.join(MODEL_NAMES)}")


def _random_qwen25_05b(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tools.standins.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model("qwen2", **QWEN25_05B_SHAPE, architectures=["Qwen2ForCausalLM"],
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process built it first
        shutil.rmtree(staging, ignore_errors=True)
    return folder
