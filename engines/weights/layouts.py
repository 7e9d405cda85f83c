"""How a mixture-of-experts model's weights are laid out: in its Hugging Face checkpoint, and in memory.

A checkpoint stores each expert's projections apart (`mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`):
what mbridge exports, what `save_pretrained` writes and the only names SGLang's MoE models load experts under.
transformers 5 holds a layer's experts as two stacked tensors instead (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), which is what a trainer's `named_tensors()` yields and a torch engine's
parameters are named. `stacks_experts` asks the installed transformers which it does (a meta-device skeleton:
no memory, no weights read); `in_model_layout` stacks checkpoint tensors as the model holds them, and
`CheckpointLayout` splits them back for an engine that loads checkpoint names (SGLang): transformers' own reverse
conversion, tensor by tensor, so a model's renames (Mixtral's `block_sparse_moe`, `w1`/`w3`/`w2`) come with it.
`checkpoint_views` gives the same names as views into a live model's stacked parameters, so an engine holding
the stacked layout can load a checkpoint-named expert into its slice in place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

_CHECKPOINT_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def meta_skeleton(hf_config: PretrainedConfig) -> PreTrainedModel:
    """The model transformers builds for `hf_config`, on the meta device: its names and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def holds_stacked_experts(model: nn.Module) -> bool:
    return any(is_stacked_expert(name) for name, _ in model.named_parameters())


def stacks_experts(hf_config: PretrainedConfig) -> bool:
    """Whether the installed transformers holds this model's experts stacked (`experts.gate_up_proj`)."""
    return holds_stacked_experts(meta_skeleton(hf_config))


def is_stacked_expert(name: str) -> bool:
    """A layer's stacked experts under transformers' in-memory name, which no checkpoint (and no SGLang) knows."""
    return _STACKED_EXPERTS.search(name) is not None


class CheckpointLayout:
    """Turns a model's in-memory tensors into its checkpoint's: each stacked expert tensor into one tensor per
    expert and projection (views, no copy), every other name as the checkpoint spells it.

    Built once per run from a meta skeleton of the model (the reverse conversion needs the model class). Each
    tensor converts alone, so a trainer's stream stays a stream: nothing waits for the rest of its layer."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        self._skeleton = meta_skeleton(hf_config)

    def __call__(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        try:
            for name, tensor in named:
                yield from revert_weight_conversion(self._skeleton, {name: tensor}).items()
        finally:
            close = getattr(named, "close", None)
            if close is not None:  # a trainer's generator finishes its collective iteration on close
                close()


def checkpoint_views(model: PreTrainedModel) -> dict[str, Tensor]:
    """Checkpoint name -> the part of the model's parameter that holds it, for each name the checkpoint spells
    differently: every expert of a stacked layer, and renamed weights (Mixtral's `block_sparse_moe.gate`).

    Writing a view writes the model's weight, as SGLang's expert weight loader writes its slice of a fused
    parameter. transformers' reverse conversion copies (its chunks are made contiguous), so it runs on a probe
    instead: each row of a stacked parameter numbered, the conversion shows which rows each checkpoint tensor
    takes. A conversion that does more than pick whole rows of one expert (a transpose) is refused by name."""
    from transformers.core_model_loading import revert_weight_conversion

    views: dict[str, Tensor] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        shapes = revert_weight_conversion(model, {name: torch.empty(parameter.shape, device="meta")})
        if not is_stacked_expert(name):
            if len(shapes) != 1 or next(iter(shapes.values())).shape != parameter.shape:
                raise ValueError(f"{name}: transformers writes it to the checkpoint as {sorted(shapes)}, which a "
                                 "checkpoint-named update cannot load in place")
            if (checkpoint_name := next(iter(shapes))) != name:
                views[checkpoint_name] = parameter.data
            continue
        experts, rows = parameter.shape[0], parameter.shape[1]
        probe = torch.arange(experts * rows).reshape(experts, rows, *([1] * (parameter.dim() - 2)))
        for checkpoint_name, numbered in revert_weight_conversion(model, {name: probe}).items():
            taken = numbered.reshape(-1)
            expert, first = divmod(int(taken[0]), rows)
            view = parameter.data[expert, first:first + taken.numel()]
            if not torch.equal(taken, torch.arange(int(taken[0]), int(taken[0]) + taken.numel())) or (
                    first + taken.numel() > rows or view.shape != shapes[checkpoint_name].shape):
                raise ValueError(f"{name}: transformers turns it into {checkpoint_name!r} by more than taking rows of "
                                 "one expert, so a checkpoint-named update cannot write the model's weight in place")
            views[checkpoint_name] = view
    return views


def in_model_layout(named: Iterable[tuple[str, Tensor]], experts: int) -> Iterator[tuple[str, Tensor]]:
    """Checkpoint-layout tensors with each layer's `experts` experts stacked as transformers 5 holds them; other
    tensors pass through in order. A layer's stacks come out once its last expert tensor went in."""
    pending: dict[str, dict[tuple[str, int], Tensor]] = {}
    for name, tensor in named:
        match = _CHECKPOINT_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        layer = pending.setdefault(prefix, {})
        layer[(projection, expert)] = tensor
        if len(layer) < 3 * experts:
            continue
        del pending[prefix]
        yield f"{prefix}.gate_up_proj", torch.stack(
            [torch.cat([layer[("gate_proj", e)], layer[("up_proj", e)]]) for e in range(experts)])
        yield f"{prefix}.down_proj", torch.stack([layer[("down_proj", e)] for e in range(experts)])
    if pending:
        raise ValueError(f"expert weights of {sorted(pending)} ended incomplete: every layer needs gate, up and down "
                         f"projections of {experts} experts")
