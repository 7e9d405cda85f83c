"""Which runs roll out in FP8 (`--rollout-fp8`, or an FP8 `--hf-checkpoint`), and which cannot: the settings it
depends on, checked with the rest of the run's."""

from __future__ import annotations

from pathlib import Path

from actors.config.engine_settings import EngineConfig
from actors.config.engines import engine_spec, engines_that
from actors.config.weights_settings import WeightsConfig


def rolls_out_fp8(weights: WeightsConfig, hf_checkpoint: str | None) -> bool:
    """--rollout-fp8, or an --hf-checkpoint that is an FP8 checkpoint: slime rolls out in FP8 exactly when its
    --hf-checkpoint is one (its pushes are quantised by that config's quantization_config), and an engine serving
    such a checkpoint can load FP8 pushes only. Read from the folder's config.json where it is a local folder."""
    if weights.rollout_fp8:
        return True
    if hf_checkpoint is None or not (Path(hf_checkpoint) / "config.json").is_file():
        return False
    from engines.checkpoint_config import is_fp8, read_config

    return is_fp8(read_config(hf_checkpoint))


def rollout_fp8_problems(weights: WeightsConfig, engine: EngineConfig, *, lora: bool = False) -> list[str]:
    """An engine that does not serve FP8 would load quantised bytes as if they were weights; an engine that loads
    adapters by name (an SGLang server: a LoRA run's, or several policies') serves them unmerged beside FP8 layers it
    does not adapt. The torch engine adapts its FP8 layers (a merged adapter, or several policies' named ones)."""
    if not weights.rollout_fp8:
        return []
    problems = []
    spec = engine_spec(engine.rollout_engine)
    if spec is None or not spec.serves_fp8:
        noun = spec.noun if spec is not None else f"the plugin engine {engine.rollout_engine!r}"
        problems.append(f"--rollout-fp8: {noun} does not serve FP8 weights; --rollout-engine "
                        f"{' or '.join(engines_that('serves_fp8'))} does")
    elif lora and spec.lora_weight_transport is not None:
        problems.append(f"--rollout-fp8 with LoRA on {spec.plural}: they load the adapter by name, unmerged beside "
                        "FP8 layers that are not adapted yet; roll LoRA out in FP8 on --rollout-engine torch (which "
                        "adapts its FP8 layers), or in full precision")
    return problems
