"""FP8 checkpoints: a Hugging Face folder whose decoder projections are stored block-quantised (`engines.weights.fp8`).

An SGLang server serves FP8 only from such a checkpoint: it reads `quantization_config` from config.json when it
builds the model and makes each projection an FP8 layer (`weight` in float8_e4m3fn, `weight_scale_inv` per tile);
the FP8 pushes of `--rollout-fp8` are then loaded into those layers under their own names. A server started on the
unquantised folder would instead copy the pushed FP8 values into its bfloat16 weights without their scales. So a run
converts `--hf-checkpoint` once (`converted`), and the server starts on the result.

The conversion writes what `fp8.quantised_push` sends, byte for byte: each projection as its FP8 values and scales
(transformers' quantiser formula, tested), every other tensor as stored, tokenizer and generation files copied, and
config.json with `fp8.quantization_config()`. The converted folder of a source is kept in a cache keyed by the
source's config and weight files (their sizes and modification times), so a later run, or another worker of the same
run, starts at once; a source that changed gets a new folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engines.checkpoint_config import CONFIG, Fp8CheckpointError, checkpoint_block, read_config
from engines.weights import fp8

INDEX = "model.safetensors.index.json"
CACHE_ENV = "SLIPSTREAM_FP8_CACHE"  # where converted checkpoints are kept; default ~/.cache/slipstream/fp8
# Weight files of other formats: not copied (the converted folder's weights are its safetensors).
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def convert(source: str | Path, target: str | Path, block: int = fp8.BLOCK) -> Path:
    """Write `source` (an unquantised HF folder with safetensors weights) as an FP8 checkpoint at `target`, which must
    not exist; written beside it first and renamed, so a folder at `target` is always whole."""
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    config = read_config(source)
    if checkpoint_block(config, str(source)) is not None:
        raise Fp8CheckpointError(f"{source}: already an FP8 checkpoint (its config.json has a quantization_config)")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise Fp8CheckpointError(f"{source}: no *.safetensors weights to convert (other formats are not read)")

    def rewrite(staging: Path) -> dict[str, str]:
        quantised, weight_map = 0, {}
        for file in files:
            tensors = {}
            for name, tensor in load_file(str(file)).items():
                for wire_name, wire in fp8.quantised_stream([(name, tensor)], None, block):
                    tensors[wire_name] = wire.contiguous()
                    weight_map[wire_name] = file.name
                quantised += fp8.quantised(name, tensor.shape)
            save_file(tensors, str(staging / file.name), metadata={"format": "pt"})
        if not quantised:
            raise Fp8CheckpointError(f"{source}: no decoder projection (layers.N.self_attn/mlp.*_proj.weight) to "
                                     "quantise; this architecture cannot be served in FP8")
        return weight_map

    config["quantization_config"] = fp8.quantization_config(block)
    return _write_folder(source, target, files, config, rewrite)


def stored_tensors(folder: str | Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The tensors of a folder's safetensors files whose names `wanted` picks, the others left unread."""
    from safetensors import safe_open

    found = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys() if wanted(key)})  # noqa: SIM118
    return found


def dequantise(source: str | Path, target: str | Path) -> Path:
    """Write the FP8 checkpoint `source` as an unquantised float32 one at `target` (which must not exist): each
    projection dequantised with its tile scales (`fp8.dequantise`, SGLang's arithmetic), every other tensor as stored.
    What a learner trains from when `--hf-checkpoint` is an FP8 checkpoint, as slime's scripts give it (slime's
    learner loads its weights from a Megatron checkpoint; this is the same weights for ours)."""
    import torch
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    config = read_config(source)
    block = checkpoint_block(config, str(source))
    if block is None:
        raise Fp8CheckpointError(f"{source}: not an FP8 checkpoint (its config.json has no quantization_config)")
    files = sorted(source.glob("*.safetensors"))
    # a projection's scales may be stored in another file than its values
    scales = stored_tensors(source, lambda key: key.endswith(fp8.SCALE_SUFFIX))
    del config["quantization_config"]
    config["torch_dtype"] = config["dtype"] = "float32"

    def unquantised(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plain = {}
        for name, tensor in tensors.items():
            if name.endswith(fp8.SCALE_SUFFIX):
                continue
            scale = scales.get(fp8.scale_name(name))
            plain[name] = tensor if scale is None else fp8.dequantise(tensor, scale, torch.float32, block)
        return plain

    def rewrite(staging: Path) -> dict[str, str]:
        weight_map = {}
        for file in files:
            tensors = unquantised(load_file(str(file)))
            save_file(tensors, str(staging / file.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file.name))
        return weight_map

    return _write_folder(source, target, files, config, rewrite)


def _write_folder(source: Path, target: Path, files: list[Path], config: dict[str, Any],
                  rewrite: Any) -> Path:
    """`source` rewritten at `target` (which must not exist): `rewrite(staging)` writes the weight files and returns
    the weight map; the other files are copied, the index and `config` written; built beside `target`, renamed."""
    if target.exists():
        raise Fp8CheckpointError(f"{target}: already exists; converting writes a new folder")
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        weight_map = rewrite(staging)
        _copy_other_files(source, staging)
        if (source / INDEX).is_file():
            index = json.loads((source / INDEX).read_text())
            sizes = sum((staging / file.name).stat().st_size for file in files)
            index.update(weight_map=weight_map, metadata={**index.get("metadata", {}), "total_size": sizes})
            (staging / INDEX).write_text(json.dumps(index, indent=2))
        (staging / CONFIG).write_text(json.dumps(config, indent=2))
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _copy_other_files(source: Path, target: Path) -> None:
    """Tokenizer, chat template, generation config and the like: every top-level file but weights and config."""
    for path in source.iterdir():
        if (path.is_file() and path.suffix not in (".safetensors", *OTHER_WEIGHTS)
                and path.name not in (CONFIG, INDEX)):
            shutil.copy2(path, target / path.name)


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slipstream" / "fp8"


def source_key(source: Path) -> str:
    """What identifies a source's contents without reading its weights: its resolved path, its config, and each
    weight file's name, size and modification time."""
    digest = hashlib.sha256(str(source.resolve()).encode())
    digest.update((source / CONFIG).read_bytes())
    for file in sorted(source.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def converted(source: str | Path, cache: str | Path | None = None, block: int = fp8.BLOCK) -> Path:
    """The FP8 checkpoint of `source`: `source` itself if it is one (in `block` tiles), else its conversion, made the
    first time into `cache` (default `cache_root()`)."""
    source = Path(source)
    stored = checkpoint_block(read_config(source), str(source))
    if stored is not None:
        if stored != block:
            raise Fp8CheckpointError(f"{source}: FP8 tiles of {stored}, the learner pushes tiles of {block}")
        return source
    target = Path(cache or cache_root()) / f"{source.resolve().name}-fp8-{block}-{source_key(source)}"
    return _made_once(target, lambda: convert(source, target, block))


def trainable(source: str | Path, cache: str | Path | None = None) -> Path:
    """The folder a learner loads `source` from: `source` itself unless it is a local FP8 checkpoint, whose
    dequantised copy (`dequantise`) is made the first time into `cache` (default `cache_root()`)."""
    source = Path(source)
    if not (source / CONFIG).is_file() or checkpoint_block(read_config(source), str(source)) is None:
        return source  # unquantised, or a hub id that transformers resolves
    target = Path(cache or cache_root()) / f"{source.resolve().name}-dequantised-{source_key(source)}"
    return _made_once(target, lambda: dequantise(source, target))


def _made_once(target: Path, make: Any) -> Path:
    """`target` if a folder is there, else what `make()` writes there. Processes making it at once each write their
    own staging folder; the first rename wins and the others use its folder."""
    if (target / CONFIG).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        return make()
    except (Fp8CheckpointError, OSError):
        if (target / CONFIG).is_file():  # another process made it meanwhile
            return target
        raise
