"""What a model folder's config.json says (an FP8 quantisation, a vision tower), read without torch: the launcher
checks these while it validates a run's settings, and an import of torch there would add a second or more to every
launch, in front of the actor template's own import of it (the FP8 conversion is `engines.fp8_checkpoint`'s, the
image processing `engines.vision`'s)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG = "config.json"


class Fp8CheckpointError(ValueError):
    """A folder that cannot be converted or served as an FP8 checkpoint; the message names it and why."""


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise Fp8CheckpointError(f"{folder}: no {CONFIG}; expected a local Hugging Face model folder")
    return json.loads(path.read_text())


def is_fp8(config: Mapping[str, Any]) -> bool:
    """Whether SGLang takes the checkpoint of this config for an FP8 one (`Fp8Config`: "fp8" in its quant_method)."""
    return "fp8" in str((config.get("quantization_config") or {}).get("quant_method", ""))


def checkpoint_block(config: Mapping[str, Any], where: str) -> int | None:
    """The tile size of an FP8 checkpoint's config (`config.json`), None for an unquantised one. Detected as SGLang's
    model config does: a `quantization_config` whose `quant_method` contains "fp8"; ours are block-scaled, square
    tiles, dynamic activations. Any other quantisation is refused by name."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = str(quantization.get("quant_method", ""))
    if "fp8" not in method or "mxfp8" in method:
        raise Fp8CheckpointError(f"{where}: quantization_config has quant_method {method!r}; FP8 rollout serves "
                                 "block-scaled FP8 (quant_method 'fp8') or an unquantised checkpoint")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and isinstance(block[0], int)):
        raise Fp8CheckpointError(f"{where}: quantization_config weight_block_size is {block!r}; FP8 rollout serves "
                                 "square tiles ([128, 128]), the layout the learner pushes")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8CheckpointError(f"{where}: activation_scheme {quantization['activation_scheme']!r}; block-scaled FP8 "
                                 "quantises activations dynamically")
    return int(block[0])


def is_vision_language(config: Mapping[str, Any]) -> bool:
    """A model folder's config.json describes a vision-language model (it has a vision tower)."""
    return "vision_config" in config
