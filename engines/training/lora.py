"""LoRA on the torch trainer, through PEFT: the adapter is what trains, what a checkpoint keeps and what travels.

PEFT rather than hand-written low-rank layers: it knows every transformers architecture's linear layers (so
`--target-modules all-linear` means the same as in any PEFT recipe), its adapter folders load in SGLang, vLLM and
`PeftModel.from_pretrained`, and its delta weights handle the layouts (fan-in/fan-out, rsLoRA scaling) a
hand-written merge would get wrong.

Names. In the trainer an adapter tensor is `base_model.model.<module>.lora_A.default.weight`. It travels to the
engines as `<module>.lora_A.weight` (and `lora_B`): the HF module path the engine knows, with the adapter's
own suffix, and the names PEFT writes in an adapter file minus its `base_model.model.` prefix. The engine merges
them into `<module>.weight` (`engines.inference.lora_merge`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor, nn

ADAPTER = "default"  # PEFT's name for the one adapter a model gets from get_peft_model
WIRE_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
PEFT_PREFIX = "base_model.model."  # what PEFT puts before HF module paths (model and files)


class LoraSettings(BaseModel):
    """The adapter's shape, as the PEFT recipe flags name it. `target_modules` holds module-name suffixes (q_proj,
    down_proj ...) or the single word all-linear (every linear layer but the output head)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(gt=0)
    alpha: float = Field(gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = ("all-linear",)

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or any(not name.strip() for name in value):
            raise ValueError(f"target_modules {list(value)}: give module names (q_proj v_proj ...) or all-linear")
        if "all-linear" in value and len(value) > 1:
            raise ValueError(f"target_modules {list(value)}: all-linear already names every linear layer")
        return value

    @classmethod
    def of_run(cls, section: Any) -> LoraSettings | None:
        """The adapter a run's `lora` section asks for, or None (`--lora-rank 0`: full fine-tuning). The learner
        and the engines both read it here, so they scale the adapter alike."""
        if section.lora_rank == 0:
            return None
        return cls(rank=section.lora_rank, alpha=section.lora_alpha, dropout=section.lora_dropout,
                   target_modules=tuple(section.target_modules))

    @property
    def scaling(self) -> float:
        """What the adapter's product is multiplied by (PEFT's `lora_alpha / r`)."""
        return self.alpha / self.rank

    def peft_config(self, exclude: str | None = None) -> Any:
        """`exclude`: a regex of module names no adapter goes on (a vision-language model's vision tower)."""
        from peft import LoraConfig

        everything = self.target_modules == ("all-linear",)
        targets: str | list[str] = "all-linear" if everything else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias="none", exclude_modules=exclude)


def wrap(model: nn.Module, settings: LoraSettings, *, exclude: str | None = None) -> nn.Module:
    """The model with fresh adapters (B = 0, so it computes exactly what the base did); only they train. `exclude`:
    see `LoraSettings.peft_config`."""
    from peft import get_peft_model

    try:
        with warnings.catch_warnings():  # PEFT reads a transformers attribute that transformers 5 deprecates
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = get_peft_model(model, settings.peft_config(exclude))
    except ValueError as error:  # PEFT's "Target modules {...} not found in the base model"
        raise ValueError(f"--target-modules {' '.join(settings.target_modules)}: {error}") from error
    if not any(True for _ in adapter_layers(wrapped)):
        raise ValueError(f"--target-modules {' '.join(settings.target_modules)}: no linear layer of "
                         f"{type(model).__name__} matched")
    return wrapped


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(HF module path, PEFT LoRA layer) for every adapted module."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name.removeprefix(PEFT_PREFIX), module


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The adapter's tensors under their wire names (module docstring), not copies."""
    for module_name, layer in adapter_layers(model):
        yield f"{module_name}.lora_A.weight", layer.lora_A[ADAPTER].weight.detach()
        yield f"{module_name}.lora_B.weight", layer.lora_B[ADAPTER].weight.detach()


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The base model's state dict with every adapter folded into its layer's weight: what a plain HF model of
    the trained policy holds. Computed beside the training weights, which stay untouched (PEFT's own
    merge_and_unload would rewrite them in place, and unmerging does not give the same floats back)."""
    base = model.get_base_model()
    layers = dict(adapter_layers(model))
    merged: dict[str, Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        module_name, _, leaf = name.rpartition(".")
        owner = module_name.removesuffix(".base_layer")
        if owner != module_name and owner in layers:
            name = f"{owner}.{leaf}"
            if leaf == "weight":
                with torch.no_grad():
                    tensor = tensor + layers[owner].get_delta_weight(ADAPTER).to(tensor.dtype)
        merged[name] = tensor.detach()
    return merged


def save_merged(model: nn.Module, directory: Path) -> None:
    """A Hugging Face folder of the merged policy (config and weights; the caller adds the tokenizer)."""
    model.get_base_model().save_pretrained(directory, state_dict=merged_state_dict(model))


def save_adapter(model: nn.Module, directory: Path) -> None:
    """PEFT's adapter folder (adapter_config.json, adapter_model.safetensors): what `PeftModel.from_pretrained`,
    SGLang's --lora-paths and vLLM load."""
    model.save_pretrained(directory)
