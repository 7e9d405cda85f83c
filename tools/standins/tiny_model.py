"""Build tiny Hugging Face causal LMs and a character-level tokenizer locally.

This machine (and CI) cannot download weights, so tests, benchmarks and the CPU demo create their models
here. The result is an ordinary HF folder (config.json, model.safetensors, tokenizer.json, chat template)
that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load like any real
checkpoint, so the code paths under test are the ones real models take.
"""

from __future__ import annotations

import os
import shutil
import string
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
# Characters cover printable ASCII so any prompt of ours tokenizes without <unk>.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
TOKENIZER_REVISION = 2  # part of a cached model's folder name: a cache written by an older tokenizer is not reused
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# How each mixture-of-experts family spells "experts per layer" in its HF config.
EXPERTS_KEY = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model; the defaults train in seconds on two CPU cores. Every field but `family`, `seed` and
    the two expert counts is a Hugging Face config key, passed to the config under its own name. The expert counts
    apply to the mixture-of-experts families only (each spells them its own way; every layer is sparse, its experts
    `intermediate_size` wide)."""

    family: str = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0
    experts: int = 4
    experts_per_token: int = 2


def byte_level_symbol(character: str) -> str:
    """The character as GPT-2 style byte-level vocabularies spell it: a space is "Ġ", a newline "Ċ"."""
    code = ord(character)
    return character if 33 <= code <= 126 else chr(256 + code) if code < 33 else chr(code)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, so decoding is exact and vocab stays ~106.

    The vocabulary is spelled byte-level (GPT-2 style) and the model is BPE without merges, so the folder loads the
    same whichever tokenizer class `AutoTokenizer` picks for the model family: transformers 5 loads a qwen2 folder
    as `Qwen2Tokenizer`, which keeps the vocabulary but brings its own byte-level pre-tokenizer and decoder; a
    plain-character vocabulary then lost every space and newline, in prompts and responses alike.
    """
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + [byte_level_symbol(c) for c in CHARACTERS])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    # Every character alone, newlines too: "." would leave a run of newlines as one piece, which has no token.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> torch.nn.Module:
    if spec.family not in ARCHITECTURES:
        raise ValueError(f"tiny model family {spec.family!r} unknown; choose one of {sorted(ARCHITECTURES)}")
    shape = {key: value for key, value in asdict(spec).items()
             if key not in ("family", "seed", "experts", "experts_per_token")}
    if spec.family in EXPERTS_KEY:
        shape |= {EXPERTS_KEY[spec.family]: spec.experts, "num_experts_per_tok": spec.experts_per_token}
        if spec.family == "qwen3_moe":  # Mixtral's experts are intermediate_size wide already
            shape["moe_intermediate_size"] = spec.intermediate_size
    config = AutoConfig.for_model(
        spec.family,
        vocab_size=len(tokenizer),
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[ARCHITECTURES[spec.family]],
    )
    if spec.family in ("qwen3", "qwen3_moe"):
        config.head_dim = spec.hidden_size // spec.num_attention_heads
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def create_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a tiny model and its tokenizer to `path` (an HF folder) and return the path."""
    path = Path(path)
    tokenizer = build_tokenizer()
    model = build_tiny_model(spec, tokenizer)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cached_tiny_model(cache_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Create the model once per spec under `cache_dir`; later calls reuse the folder."""
    fields = dict(spec.__dict__)
    if spec.family not in EXPERTS_KEY:  # a dense model's folder name leaves out the expert counts it ignores
        del fields["experts"], fields["experts_per_token"]
    key = "-".join(str(value) for value in [*fields.values(), f"tok{TOKENIZER_REVISION}"])
    return cached_folder(Path(cache_dir) / f"tiny-{key}", lambda staging: create_tiny_model(staging, spec))


def cached_folder(path: Path, create: Callable[[Path], object]) -> Path:
    """`path`, made by `create(folder)` unless it holds a model already. A staging folder per process: two tools (or
    two test workers) may build the same model at once; the first rename wins and the other copy is dropped."""
    if not (path / "config.json").exists():
        staging = path.with_name(f"{path.name}.partial-{os.getpid()}")
        create(staging)
        try:
            staging.rename(path)
        except OSError:
            if not (path / "config.json").exists():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    return path
