"""FP8 rollout on SGLang servers (`--rollout-fp8`): which models SGLang can serve in FP8, and on what checkpoint.

SGLang serves FP8 only from an FP8 checkpoint (`engines.fp8_checkpoint`): a server the rollout worker starts itself
is started on the conversion of `--hf-checkpoint` (`launch_checkpoint`); an attached one (`--sglang-url`) must have
been started on one, which is checked where SGLang says what it serves (`attached_problem`).

SGLang refuses block-FP8 projections whose tensor-parallel shards do not split into whole tiles. Its rule, in both
pinned releases (`Fp8LinearMethod.validate_block_quant_shapes`, `layers/quantization/fp8.py`; tested against their
source), for a layer split over `tp` ranks:

* a merged layer (q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`), and any column-parallel layer split
  over tp > 1 ranks: every part's output size per shard must divide by the tile;
* a row-parallel layer (`o_proj`, `down_proj`) split over tp > 1 ranks: its input size per shard must divide by it.

So even at tp 1 the q, k and v outputs and the MLP's width must be multiples of 128: SmolLM2-135M's 576 and 192 are
not, and it rolls out in FP8 on the torch engine, which scales ragged tiles on their own.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engines.checkpoint_config import Fp8CheckpointError, checkpoint_block, read_config
from engines.fp8_checkpoint import converted
from engines.sglang import protocol
from engines.weights import fp8

logger = logging.getLogger(__name__)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _shards(size: int, tp_size: int, what: str, where: str) -> int:
    if size % tp_size:
        raise Fp8CheckpointError(f"{where}: {what} {size} does not split over {tp_size} tensor-parallel ranks")
    return size // tp_size


def block_shape_problems(config: Mapping[str, Any], tp_size: int, where: str, block: int = fp8.BLOCK) -> list[str]:
    """Each projection SGLang would refuse to serve in `block` tiles over `tp_size` ranks, naming its tensor and
    sizes; [] when it serves them all. A mixture-of-experts model is refused whole: the conversion quantises
    dense projections only, and SGLang's FP8 expert layers would take the experts as FP8 too."""
    experts = [key for key in EXPERT_KEYS if config.get(key)]
    if experts:
        return [f"{where}: a mixture-of-experts model ({experts[0]} {config[experts[0]]}); FP8 rollout on SGLang "
                "converts dense decoder projections only, roll it out in FP8 on the torch engine"]
    try:
        return _tile_problems(config, tp_size, where, block)
    except (Fp8CheckpointError, KeyError, TypeError, ValueError) as error:  # a config SGLang would not start on
        return [f"{where}: cannot tell how SGLang shards it over {tp_size} ranks: {error!r}"]


def _tile_problems(config: Mapping[str, Any], tp_size: int, where: str, block: int) -> list[str]:
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    width = int(config["intermediate_size"])
    kv_per_shard = 1 if tp_size >= kv_heads else _shards(kv_heads, tp_size, "num_key_value_heads", where)
    q_out = _shards(heads, tp_size, "num_attention_heads", where) * head_dim
    outputs = {"self_attn.q_proj": q_out, "self_attn.k_proj": kv_per_shard * head_dim,
               "self_attn.v_proj": kv_per_shard * head_dim, "mlp.gate_proj": _shards(width, tp_size, "width", where),
               "mlp.up_proj": width // tp_size}  # merged layers: checked at any tp
    inputs = {"self_attn.o_proj": heads * head_dim // tp_size, "mlp.down_proj": width // tp_size}  # row-parallel
    if tp_size == 1:
        inputs = {}
    problems = [f"layers.*.{name}.weight: output size {size} per tensor-parallel shard (tp {tp_size}) is not "
                f"divisible by the FP8 tile {block}" for name, size in outputs.items() if size % block]
    problems += [f"layers.*.{name}.weight: input size {size} per tensor-parallel shard (tp {tp_size}) is not "
                 f"divisible by the FP8 tile {block}" for name, size in inputs.items() if size % block]
    if problems:
        problems = [f"{where}: SGLang cannot serve it in block FP8: {'; '.join(problems)}; roll it out in FP8 on "
                    "the torch engine (--rollout-engine torch), which scales ragged tiles"]
    return problems


def launch_checkpoint(hf_checkpoint: str | Path, tp_size: int, cache: str | Path | None = None) -> Path:
    """The folder a server launched for an FP8 rollout starts on: `hf_checkpoint` converted (once, cached), after
    SGLang's shape rule is checked; refused naming the tensors it would fail on."""
    problems = block_shape_problems(read_config(hf_checkpoint), tp_size, f"--hf-checkpoint {hf_checkpoint}")
    if problems:
        raise Fp8CheckpointError(problems[0])
    folder = converted(hf_checkpoint, cache)
    logger.info("--rollout-fp8: SGLang serves %s (the FP8 checkpoint of %s)", folder, hf_checkpoint)
    return folder


def attached_problem(url: str, timeout_s: float) -> str | None:
    """Why the attached server at `url` cannot take FP8 pushes (it serves an unquantised checkpoint, or one in
    other tiles), or None. SGLang reports the checkpoint it serves only as `/model_info`'s `model_path` (the
    quantisation it detected from the checkpoint appears in no answer of either pinned release), so the check reads
    that folder's config.json, or the local Hugging Face cache's copy for a hub id; where neither is readable from
    here it is logged as unchecked."""
    try:
        with urllib.request.urlopen(f"{url}{protocol.MODEL_INFO.path}", timeout=timeout_s) as response:
            model_path = json.loads(response.read()).get("model_path")
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as error:
        logger.warning("--rollout-fp8: %s: cannot read %s (%s); not checked that it serves an FP8 checkpoint", url,
                       protocol.MODEL_INFO.path, error)
        return None
    config = _readable_config(str(model_path)) if model_path else None
    if config is None:
        logger.warning("--rollout-fp8: %s serves %r, whose config.json is not readable here; not checked that it is "
                       "an FP8 checkpoint", url, model_path)
        return None
    try:
        block = checkpoint_block(config, f"--sglang-url {url} ({model_path})")
    except Fp8CheckpointError as error:
        return str(error)
    if block is None:
        return (f"--rollout-fp8: --sglang-url {url} serves {model_path}, an unquantised checkpoint, which would load "
                "the pushed FP8 values without their scales; start it on an FP8 checkpoint "
                f"(python -m tools.convert_fp8 {model_path} FP8_DIR)")
    if block != fp8.BLOCK:
        return (f"--rollout-fp8: --sglang-url {url} serves {model_path} in FP8 tiles of {block}, the pushes use "
                f"{fp8.BLOCK}")
    return None


def _readable_config(model_path: str) -> dict[str, Any] | None:
    folder = Path(model_path).expanduser()
    if (folder / "config.json").is_file():
        return read_config(folder)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json")
    except (ImportError, ValueError):
        return None
    return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None
