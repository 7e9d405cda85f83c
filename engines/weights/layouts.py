"""How a mixture-of-experts model's weights are laid out: in its Hugging Face checkpoint, and in memory.

A checkpoint stores each expert's projections apart (`mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`):
what mbridge exports, what `save_pretrained` writes and the only names SGLang's MoE models load experts under.
transformers 5 holds a layer's experts as two stacked tensors instead (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), which is what a trainer's `named_tensors()` yields and a torch engine's
parameters are named. `stacks_experts` asks the installed transformers which it does (a meta-device skeleton:
no memory, no weights read); `in_model_layout` stacks checkpoint tensors as the model holds them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor
from transformers import PretrainedConfig

_CHECKPOINT_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stacks_experts(hf_config: PretrainedConfig) -> bool:
    """Whether the installed transformers holds this model's experts stacked (`experts.gate_up_proj`)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    return any(name.endswith(".mlp.experts.gate_up_proj") for name, _ in skeleton.named_parameters())


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
