"""Multi-token-prediction (MTP) layers trained beside the policy (slime's `--enable-mtp-training`).

Why: SGLang's EAGLE speculative decoding drafts with a model's MTP layers. RL moves the policy away from the
checkpoint the layers were trained with, and the draft's acceptance rate, hence the rollout speed-up, decays with
it. Training them on the batches the policy trains on keeps the draft in step.

What they compute is DeepSeek-V3's MTP (its report, section 2.2), as megatron-core builds it: depth k reads the
previous depth's output at position i (depth 1: the policy's last hidden state, after its final norm) and the
embedding of token i+k, normalises each, projects their concatenation back to the hidden size, runs one decoder
layer of the policy's own kind, normalises, and predicts token i+k+1 through the policy's output head. Each depth's
loss is the cross-entropy of the trained response tokens; their sum, times --mtp-loss-scaling-factor over the
depth count (megatron's scale), joins the policy's loss.

The policy gets no gradient from it: the hidden states, embeddings and output weight that enter the MTP layers are
detached, as slime's patch of megatron-core does, so the policy trains exactly as without MTP (up to joint gradient
clipping) and only the draft learns to follow it.

Where the weights start: the checkpoint's MTP layers when it has them, in the two layouts models ship them in
(DeepSeek-V3's and GLM-4.5's extra layers `model.layers.{L+k}.*`, MiMo's `model.mtp_layers.{k}.*`, whose projection
reads the hidden state before the embedding); a checkpoint without them gets fresh layers, each a copy of the
policy's last decoder layer (a draft that already reads the policy's features) behind a projection drawn as the
model's initialiser draws its linear layers. `export` writes them back in the checkpoint's layout.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from engines.training.config import MtpSettings
from engines.training.micro_batches import PackedInputs, forward_packed
from engines.training.output_head import head_log_probs
from engines.weights import layouts
from engines.weights.layouts import Slot

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "mtp.safetensors"  # in a checkpoint (our names) and an HF export (the layout's names)


@dataclass(frozen=True)
class MtpLayout:
    """How a family's HF checkpoint names its MTP layers: each depth's prefix, and its four MTP-only parts."""

    name: str
    prefix_format: str  # with {depth} (0-based) and {layer} (num_hidden_layers + depth)
    enorm: str
    hnorm: str
    eh_proj: str
    norm: str
    hidden_first: bool  # the projection's input is [hidden state, embedding] (MiMo) rather than the reverse
    shared: tuple[str, ...] = ()  # the policy's own tensors a depth repeats under its prefix (DeepSeek-V3's)

    def prefix(self, depth: int, num_hidden_layers: int) -> str:
        return self.prefix_format.format(depth=depth, layer=num_hidden_layers + depth)


NEXTN = MtpLayout("nextn", "model.layers.{layer}.", "enorm", "hnorm", "eh_proj", "shared_head.norm",
                  hidden_first=False, shared=("embed_tokens.weight", "shared_head.head.weight"))
MIMO = MtpLayout("mimo", "model.mtp_layers.{depth}.", "token_layernorm", "hidden_layernorm", "input_proj",
                 "final_layernorm", hidden_first=True)
LAYOUT_OF_MODEL_TYPE = {"mimo": MIMO}  # every other family: DeepSeek-V3's, which GLM-4.5 and later share


def layout_of(model_type: str) -> MtpLayout:
    return LAYOUT_OF_MODEL_TYPE.get(model_type, NEXTN)


class MtpDepth(nn.Module):
    """One depth: norms of the embedding and the hidden state, their projection, a decoder layer, the output norm."""

    def __init__(self, decoder_layer: nn.Module, final_norm: nn.Module, hidden_size: int) -> None:
        super().__init__()
        eps = getattr(final_norm, "variance_epsilon", getattr(final_norm, "eps", 1e-6))
        self.enorm = type(final_norm)(hidden_size, eps=eps)
        self.hnorm = type(final_norm)(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = decoder_layer
        self.norm = type(final_norm)(hidden_size, eps=eps)

    def forward(self, hidden: Tensor, embedded: Tensor, layer_kwargs: dict[str, Any]) -> Tensor:
        mixed = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        output = self.layer(mixed, **layer_kwargs)
        return self.norm(output[0] if isinstance(output, tuple) else output)


class _DetachedHead(NamedTuple):
    """The policy's output head as the MTP loss reads it: its weight without a path back to the policy."""

    weight: Tensor
    bias: Tensor | None


class MultiTokenPredictor:
    """The MTP depths of one policy model, the hooks that lend them its last hidden states, and their loss."""

    def __init__(self, model: nn.Module, settings: MtpSettings, checkpoint: Path) -> None:
        config = model.config
        if getattr(config, "vision_config", None) is not None:
            raise ValueError(f"--enable-mtp-training: {type(model).__name__} is a vision-language model; MTP layers "
                             "are trained for text models only")
        decoder = model.get_decoder()
        layers, final_norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
        if not isinstance(layers, nn.ModuleList) or not isinstance(final_norm, nn.Module):
            raise ValueError(f"--enable-mtp-training: {type(model).__name__}'s decoder has no `layers` and `norm` to "
                             "build MTP layers from")
        self.settings = settings
        self.layout = NEXTN  # until the checkpoint says
        self._num_hidden_layers = int(config.num_hidden_layers)
        self._embed = model.get_input_embeddings()
        self._head = model.get_output_embeddings()
        parameter = next(model.parameters())
        self.module = nn.ModuleList(MtpDepth(copy.deepcopy(layers[-1]), final_norm, config.hidden_size)
                                    for _ in range(settings.num_layers)).to(parameter.device, parameter.dtype)
        for depth in self.module:
            nn.init.normal_(depth.eh_proj.weight, std=float(getattr(config, "initializer_range", 0.02)))
        self._layer_slots = _layer_slots(model, layers[-1])
        self.source = self._load_from_hf(checkpoint, config.model_type)
        self._capturing = False
        self._hidden: Tensor | None = None
        self._layer_kwargs: dict[str, Any] | None = None
        final_norm.register_forward_hook(self._keep_hidden)
        layers[-1].register_forward_pre_hook(self._keep_layer_kwargs, with_kwargs=True)

    # -- the policy's forward, lent --------------------------------------------------------------------------

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """A policy forward inside it leaves its last hidden states and its decoder layers' arguments here."""
        self._capturing, self._hidden, self._layer_kwargs = True, None, None
        try:
            yield
        finally:
            self._capturing = False

    def _keep_hidden(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        if self._capturing:
            self._hidden = output.detach()

    def _keep_layer_kwargs(self, module: nn.Module, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> None:
        if self._capturing and self._layer_kwargs is None:  # a recomputing checkpoint calls it again
            self._layer_kwargs = {key: value for key, value in kwargs.items() if key != "hidden_states"}

    # -- training --------------------------------------------------------------------------------------------

    def loss(self, inputs: PackedInputs, loss_mask: Tensor | None, loss_tokens: int) -> tuple[Tensor, dict[str, Any]]:
        """This micro-batch's share of the step's MTP loss, and each depth's cross-entropy per trained token of the
        step (sums over micro-batches and ranks, like the policy's loss terms)."""
        head = self._detached_head()
        weights = torch.ones_like(inputs.targets, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        denominator = max(loss_tokens, 1)
        total = torch.zeros((), device=inputs.targets.device)
        metrics: dict[str, Any] = {}
        for depth, predicting, same_sample in self._depth_outputs(inputs):
            predicted = head_log_probs(predicting, head, inputs.targets,  # type: ignore[arg-type]
                                       temperature=1.0, with_entropy=False)
            cross_entropy = -(predicted.log_probs * weights * same_sample).sum() / denominator
            total = total + cross_entropy
            metrics[f"mtp_{depth}_loss"] = cross_entropy.detach()
        metrics["mtp_loss"] = total.detach()
        return total * (self.settings.loss_scaling_factor / len(self.module)), metrics

    def top1_agreement(self, model: nn.Module, rows: Iterable[PackedInputs]) -> list[float]:
        """Per depth, the share of the rows' response tokens its top-1 guess names: what greedy speculative
        decoding would accept of that depth's proposals on these samples. Runs the policy's forward itself."""
        head = self._detached_head()
        hits, counts = torch.zeros(len(self.module)), torch.zeros(len(self.module))
        with torch.no_grad():
            for inputs in rows:
                with self.capturing():
                    forward_packed(model, inputs)
                for depth, predicting, same_sample in self._depth_outputs(inputs):
                    guesses = (predicting @ head.weight.T + (0 if head.bias is None else head.bias)).argmax(-1)
                    hits[depth - 1] += float(((guesses == inputs.targets) & same_sample).sum())
                    counts[depth - 1] += float(same_sample.sum())
        return (hits / counts.clamp(min=1)).tolist()

    def _depth_outputs(self, inputs: PackedInputs) -> Iterator[tuple[int, Tensor, Tensor]]:
        """Per depth k: its outputs at the rows that predict the row's response tokens, and which of those rows hold
        the token's own sample. Depth k predicts response token j from the row position k before the policy's,
        which is the same sample's when that position's text position is at least k (rows are packed unshared, each
        sample from position 0). Reads the captured forward and lets it go."""
        hidden, kwargs = self._hidden, self._layer_kwargs
        if hidden is None or kwargs is None:
            raise RuntimeError("MTP layers: no policy forward was captured (run it inside `capturing()`)")
        self._hidden = self._layer_kwargs = None  # the row's activations go with its backward
        ids, at = inputs.input_ids, inputs.logit_positions
        for depth, layer in enumerate(self.module, start=1):
            with torch.no_grad():
                embedded = self._embed(torch.cat([ids[:, depth:], ids.new_zeros((1, depth))], dim=1))
            hidden = layer(hidden, embedded.to(hidden.dtype), kwargs)
            yield depth, hidden[0, (at - depth).clamp(min=0)], inputs.position_ids[0, at] >= depth

    def _detached_head(self) -> _DetachedHead:
        return _DetachedHead(self._head.weight.detach(), None if self._head.bias is None else self._head.bias.detach())

    def sum_gradients(self, group: dist.ProcessGroup | None) -> None:
        """Sum the depths' gradients over the data-parallel ranks (the policy's are summed by its DDP wrapper).
        A parameter without a gradient (an expert no token reached) counts as zero, so every rank sends the same."""
        parameters = [parameter for parameter in self.module.parameters() if parameter.requires_grad]
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
        dist.all_reduce(flat, group=group)
        offset = 0
        for parameter in parameters:
            count = parameter.numel()
            parameter.grad.copy_(flat[offset: offset + count].view_as(parameter))
            offset += count

    # -- weights ---------------------------------------------------------------------------------------------

    def checkpoint_entries(self, layout: MtpLayout) -> list[tuple[str, str, Slot | None]]:
        """(HF name in `layout`, our parameter, the part of it that HF tensor is) for every tensor a checkpoint
        holds of the depths: a mixture-of-experts layer's stacked experts (transformers 5 holds them so) are one
        tensor per expert and projection there, as in the policy's own layers."""
        entries: list[tuple[str, str, Slot | None]] = []
        for name in self.module.state_dict():
            depth, _, rest = name.partition(".")
            prefix = layout.prefix(int(depth), self._num_hidden_layers)
            part, _, suffix = rest.partition(".")
            if part != "layer":
                entries.append((prefix + getattr(layout, part) + "." + suffix, name, None))
            elif suffix in self._layer_slots:
                entries.extend((prefix + stored, name, slot) for stored, slot in self._layer_slots[suffix])
            else:
                entries.append((prefix + suffix, name, None))
        return entries

    def _load_from_hf(self, checkpoint: Path, model_type: str) -> str:
        """The checkpoint's MTP layers into the depths, in whichever layout it holds them: all of them, or none
        (fresh layers, exported in the family's layout); anything between is an error naming what is missing."""
        shards: dict[str, Path] = {}
        for shard in sorted(Path(checkpoint).glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                shards.update(dict.fromkeys(handle.keys(), shard))
        for layout in (MIMO, NEXTN):
            entries = self.checkpoint_entries(layout)
            if any(stored in shards for stored, _, _ in entries):
                break
        else:
            self.layout = layout_of(model_type)
            logger.info("MTP layers start afresh: %s holds no MTP weights", checkpoint)
            return "fresh"
        self.layout = layout
        missing = [stored for stored, _, _ in entries if stored not in shards]
        if missing:
            raise ValueError(f"--mtp-num-layers {len(self.module)}: {checkpoint} holds some MTP weights of the "
                             f"{layout.name} layout but not {missing[:5]} ({len(missing)} missing)")
        state = {name: tensor.clone() for name, tensor in self.module.state_dict().items()}
        for shard in sorted(set(shards[stored] for stored, _, _ in entries)):  # each shard opened once
            with safe_open(str(shard), framework="pt") as handle:
                for stored, name, slot in entries:
                    if shards[stored] != shard:
                        continue
                    if slot is None:
                        state[name] = self._from_layout(name, handle.get_tensor(stored))
                    else:
                        slot.of(state[name]).copy_(handle.get_tensor(stored))
        self.load_state_dict(state)
        return "checkpoint"

    def _from_layout(self, name: str, tensor: Tensor) -> Tensor:
        """A projection stored hidden-first (MiMo) has its input halves swapped into ours (embedding first)."""
        if self.layout.hidden_first and name.endswith("eh_proj.weight"):
            first, second = tensor.chunk(2, dim=1)
            return torch.cat([second, first], dim=1)
        return tensor

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"MTP weights do not match --mtp-num-layers {len(self.module)} on this model (missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]})")

    def state_dict(self) -> dict[str, Tensor]:
        return {name: tensor.detach().cpu().contiguous() for name, tensor in self.module.state_dict().items()}

    def export(self, directory: Path) -> None:
        """Write the depths into an HF export in the layout's names (`WEIGHTS_FILE`, listed in the export's
        safetensors index when it has one), with the policy's shared tensors repeated where the layout does, and
        the MTP depth count in its config, as the family's checkpoints carry them."""
        state = self.state_dict()
        renamed = {stored: (self._from_layout(name, state[name]) if slot is None else slot.of(state[name]).clone())
                   for stored, name, slot in self.checkpoint_entries(self.layout)}
        shared = {"embed_tokens.weight": self._embed.weight, "shared_head.head.weight": self._head.weight}
        for depth in range(len(self.module)):
            prefix = self.layout.prefix(depth, self._num_hidden_layers)
            for name in self.layout.shared:
                renamed[prefix + name] = shared[name].detach().cpu().clone()
        save_file(renamed, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        config["num_nextn_predict_layers"] = len(self.module)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        index_path = directory / "model.safetensors.index.json"
        if index_path.is_file():
            index = json.loads(index_path.read_text())
            index["weight_map"].update({name: WEIGHTS_FILE for name in renamed})
            index_path.write_text(json.dumps(index, indent=2) + "\n")


def _layer_slots(model: nn.Module, last_layer: nn.Module) -> dict[str, list[tuple[str, Slot]]]:
    """Within a decoder layer: parameter -> the checkpoint tensors it is made of, where transformers names or stacks
    them differently from the checkpoint (read off the policy's last layer, which the depths copy)."""
    if not layouts.renamed_in_checkpoint(model):
        return {}
    prefix = next(name for name, module in model.named_modules() if module is last_layer) + "."
    parts: dict[str, list[tuple[str, Slot]]] = {}
    for stored, slot in layouts.checkpoint_slots(layouts.meta_skeleton(model.config)).items():
        if stored.startswith(prefix) and slot.parameter.startswith(prefix):
            parts.setdefault(slot.parameter[len(prefix):], []).append((stored[len(prefix):], slot))
    return parts
