"""How a mixture-of-experts model's weights are laid out: in its Hugging Face checkpoint, and in memory.

A checkpoint stores each expert's projections apart (`mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`):
what mbridge exports, what `save_pretrained` writes and the only names SGLang's MoE models load experts under.
transformers 5 holds a layer's experts as two stacked tensors instead (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), which is what a trainer's `named_tensors()` yields and a torch engine's
parameters are named. `stacks_experts` asks the installed transformers which it does (a meta-device skeleton:
no memory, no weights read); `ModelLayout` stacks checkpoint tensors as the model holds them, and
`CheckpointLayout` splits them back for an engine that loads checkpoint names (SGLang). All three read one map,
`checkpoint_slots`, found with transformers' own reverse conversion, so a model's renames (Mixtral's
`block_sparse_moe`, `w1`/`w3`/`w2`) come with it; `checkpoint_views` gives the same names as views into a live
model's stacked parameters, so an engine holding the stacked layout loads a checkpoint-named expert in place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def meta_skeleton(hf_config: PretrainedConfig) -> PreTrainedModel:
    """The model transformers builds for `hf_config`, on the meta device: its names and shapes, no memory."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision_language = getattr(hf_config, "vision_config", None) is not None  # the causal-LM class refuses it
    with torch.device("meta"):
        return (AutoModelForImageTextToText if vision_language else AutoModelForCausalLM).from_config(hf_config)


def holds_stacked_experts(model: nn.Module) -> bool:
    return any(is_stacked_expert(name) for name, _ in model.named_parameters())


def renamed_in_checkpoint(model: nn.Module) -> bool:
    """Whether the model's checkpoint names differ from its own: stacked experts, or a vision-language model's
    (transformers 5 holds `model.language_model.layers` and `model.visual`, the checkpoint `model.layers` and
    `visual`)."""
    return holds_stacked_experts(model) or getattr(model.config, "vision_config", None) is not None


def stacks_experts(hf_config: PretrainedConfig) -> bool:
    """Whether the installed transformers holds this model's experts stacked (`experts.gate_up_proj`)."""
    return holds_stacked_experts(meta_skeleton(hf_config))


def is_stacked_expert(name: str) -> bool:
    """A layer's stacked experts under transformers' in-memory name, which no checkpoint (and no SGLang) knows."""
    return _STACKED_EXPERTS.search(name) is not None


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor lives in the model: rows [first, first + rows) of expert `expert` of a stacked
    parameter, or (expert None) the whole parameter under another name."""

    parameter: str
    expert: int | None = None
    first: int = 0
    rows: int = 0

    def of(self, tensor: Tensor) -> Tensor:
        """The part of the parameter's `tensor` this slot names (a view)."""
        return tensor if self.expert is None else tensor[self.expert, self.first:self.first + self.rows]


def checkpoint_slots(model: nn.Module) -> dict[str, Slot]:
    """Checkpoint name -> its `Slot`, for each name the checkpoint spells differently from the model (every
    expert of a stacked layer, renamed weights such as Mixtral's `block_sparse_moe.gate`). Meta parameters do.

    transformers' reverse conversion copies (its chunks are made contiguous), so it runs on a probe: each row of a
    stacked parameter numbered, the conversion shows which rows each checkpoint tensor takes. A conversion that
    does more than pick whole rows of one expert (a transpose) is refused by name."""
    from transformers.core_model_loading import revert_weight_conversion

    slots: dict[str, Slot] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        shapes = revert_weight_conversion(model, {name: torch.empty(parameter.shape, device="meta")})
        if not is_stacked_expert(name):
            if len(shapes) != 1 or next(iter(shapes.values())).shape != parameter.shape:
                raise ValueError(f"{name}: transformers writes it to the checkpoint as {sorted(shapes)}, which no "
                                 "slot of the model's weight holds")
            if (checkpoint_name := next(iter(shapes))) != name:
                slots[checkpoint_name] = Slot(name)
            continue
        experts, rows = parameter.shape[0], parameter.shape[1]
        probe = torch.arange(experts * rows).reshape(experts, rows, *([1] * (parameter.dim() - 2)))
        for checkpoint_name, numbered in revert_weight_conversion(model, {name: probe}).items():
            taken = numbered.reshape(-1)
            expert, first = divmod(int(taken[0]), rows)
            slot = Slot(name, expert, first, taken.numel())
            if not torch.equal(taken, torch.arange(int(taken[0]), int(taken[0]) + taken.numel())) or (
                    first + taken.numel() > rows
                    or slot.of(torch.empty(parameter.shape, device="meta")).shape != shapes[checkpoint_name].shape):
                raise ValueError(f"{name}: transformers turns it into {checkpoint_name!r} by more than taking rows of "
                                 "one expert, so a checkpoint tensor has no slot in the model's weight")
            slots[checkpoint_name] = slot
    return slots


def checkpoint_views(model: nn.Module) -> dict[str, Tensor]:
    """Checkpoint name -> the part of the model's parameter that holds it (`checkpoint_slots`): writing the view
    writes the weight, as SGLang's expert weight loader writes its slice of a fused parameter."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    return {name: slot.of(parameters[slot.parameter].data) for name, slot in checkpoint_slots(model).items()}


class CheckpointLayout:
    """Turns a model's in-memory tensors into its checkpoint's: each stacked expert tensor into one view per
    expert and projection (`checkpoint_slots`, no copy), renamed weights renamed, the rest as they are.

    Built once per run from a meta skeleton of the model. Each tensor converts alone, so a trainer's stream stays a
    stream: nothing waits for the rest of its layer."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        self._parts: dict[str, list[tuple[str, Slot]]] = {}  # model parameter -> its checkpoint tensors
        for name, slot in checkpoint_slots(meta_skeleton(hf_config)).items():
            self._parts.setdefault(slot.parameter, []).append((name, slot))

    def __call__(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        try:
            for name, tensor in named:
                parts = self._parts.get(name)
                if parts is None:
                    yield name, tensor
                else:
                    yield from ((part, slot.of(tensor)) for part, slot in parts)
        finally:
            close = getattr(named, "close", None)
            if close is not None:  # a trainer's generator finishes its collective iteration on close
                close()


class ModelLayout:
    """Checkpoint-layout tensors (mbridge's export) under the names and shapes of the HF model in memory: each
    stacked parameter assembled from its experts' tensors, renamed weights renamed, the rest passed on in order.
    A stacked parameter comes out once its last piece went in; the pieces of one are held until then."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        skeleton = meta_skeleton(hf_config)
        self._slots = checkpoint_slots(skeleton)
        self._shapes = {name: tuple(parameter.shape) for name, parameter in skeleton.named_parameters()}
        self._pieces: dict[str, int] = {}  # stacked parameter -> the checkpoint tensors it is made of
        for slot in self._slots.values():
            if slot.expert is not None:
                self._pieces[slot.parameter] = self._pieces.get(slot.parameter, 0) + 1

    def __call__(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        pending: dict[str, tuple[Tensor, int]] = {}  # stacked parameter -> (being filled, pieces in)
        for name, tensor in named:
            slot = self._slots.get(name)
            if slot is None:
                yield name, tensor
                continue
            if slot.expert is None:
                yield slot.parameter, tensor
                continue
            stacked, filled = pending.get(slot.parameter) or (
                torch.empty(self._shapes[slot.parameter], dtype=tensor.dtype, device=tensor.device), 0)
            slot.of(stacked).copy_(tensor)
            if filled + 1 < self._pieces[slot.parameter]:
                pending[slot.parameter] = (stacked, filled + 1)
                continue
            pending.pop(slot.parameter, None)
            yield slot.parameter, stacked
        if pending:
            raise ValueError(f"expert weights of {sorted(pending)} ended incomplete: every expert's projections "
                             "must arrive")
