"""Turn a GGUF file into an ordinary Hugging Face model folder, once.

Every part of Slipstream loads models with `from_pretrained(folder)`: the trainer, the torch engine, SGLang, the
Megatron bridge. transformers can read a GGUF file (dequantising it), but refuses to save a model loaded that way,
and reading one costs ~30 s of dequantisation per load. So a GGUF is converted once into the form everything else
reads: safetensors weights in float32 (the dequantised values, exactly), the tokenizer with its chat template, and
the generation config. The converted folder is checked against the GGUF before it is kept: the same logits on a
probe prompt, or the conversion fails.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

PROBE_TEXT = "The capital of France is Paris. 12 + 30 = 42."


class GgufConversionError(RuntimeError):
    """The GGUF file could not be turned into a model folder; the message names the file and the reason."""


def load_gguf(gguf_file: Path) -> tuple[PreTrainedModel, object]:
    """The dequantised model (float32) and its tokenizer, read by transformers' GGUF loader."""
    if not gguf_file.is_file():
        raise GgufConversionError(f"{gguf_file}: no such GGUF file")
    try:
        with one_read_per_file():
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                         dtype=torch.float32)
    except (ValueError, KeyError, OSError, ImportError) as error:
        # transformers names unsupported architectures and quantisation types in a ValueError
        raise GgufConversionError(f"{gguf_file}: transformers cannot load it: {error}") from error
    return model, tokenizer


@contextlib.contextmanager
def one_read_per_file() -> Iterator[None]:
    """transformers' GGUF loader reads the file anew for the tokenizer, for the config and for the weights (each read
    parses every metadata field in Python: seconds for SmolLM2's vocabulary), and builds gguf's tensor-name map again
    for every module it walks. Inside this block each file is read once and each map built once (their callers only
    read them); a fresh-clone test run converts SmolLM2 in about half the time."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: str | Path, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def plain_model(quantized: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model with no quantisation record, which `save_pretrained` accepts.

    Built from a copy of the config without `quantization_config`; the state dict carries tied weights under both
    names, and re-tying after the load keeps the saved file to one copy of the embedding.
    """
    config = AutoConfig.for_model(**{key: value for key, value in quantized.config.to_dict().items()
                                     if key not in ("quantization_config", "model_type")},
                                  model_type=quantized.config.model_type)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False, assign=True)
    if unexpected or [name for name in missing if name not in tied_names(model)]:
        raise GgufConversionError(f"weights do not fit the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = quantized.generation_config
    return model.eval()


def tied_names(model: PreTrainedModel) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if not isinstance(tied, dict) else set(tied) | set(tied.values())


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write `gguf_file` as an HF folder at `out_dir` (which must not exist) and return the folder."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if out_dir.exists():
        raise GgufConversionError(f"{out_dir}: already exists; converting writes a new folder")
    quantized, tokenizer = load_gguf(gguf_file)
    model = plain_model(quantized)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    try:
        check_same_logits(quantized, out_dir, tokenizer)
    except GgufConversionError:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return out_dir


def check_same_logits(reference: PreTrainedModel, folder: Path, tokenizer: object) -> None:
    """The saved folder, loaded as any user would load it, must compute what the GGUF computes."""
    probe = torch.tensor([tokenizer(PROBE_TEXT)["input_ids"]])
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, got = reference(probe).logits, reloaded(probe).logits
    if not torch.equal(expected, got):
        difference = (expected - got).abs().max().item()
        raise GgufConversionError(f"{folder}: the saved model's logits differ from the GGUF's by up to {difference}")
