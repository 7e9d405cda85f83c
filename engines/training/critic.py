"""The value model of PPO with a critic, trained beside the policy with its own optimizer.

The critic is a causal LM whose output head is replaced by a 1-wide linear layer (zeros at the start, so its first
values are 0 and GAE starts as Monte-Carlo returns): it is loaded from the policy's checkpoint, as slime
initialises its critic from the actor's (untied from the embeddings), or from a folder of its own. Because the
head is still the model's output head, a critic forward is the policy's forward: the same packed rows, the same
shared-prompt packing and attention, and `logits_to_keep` at the positions that predict the response tokens, so
the value of token t is read from the state of the prefix before it, exactly where the policy reads log pi(t).
The value head sees the same tokens and the same loss masks as the policy (multi-turn masks included): it gets the
learner's `TrainSample`s themselves.

Ranks: every data-parallel rank holds a full critic and trains on its shard; the gradients are summed by one
all-reduce per parameter before the clip (the loss is already divided by the whole step's counts), so every rank
takes the same update.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_model, save_model
from torch import Tensor, nn

from engines.training import checkpoint
from engines.training.base import (
    StepResult,
    StepStats,
    TrainSample,
    ValueLossFn,
    check_loss,
    skip_reason,
    step_result,
)
from engines.training.config import CriticSettings
from engines.training.micro_batches import PackedInputs, collate, forward_packed, pack_inputs
from engines.training.optimizers import build_adam

CRITIC_DIRECTORY = "critic"  # inside a trainer checkpoint


class ValueCritic:
    """See the module docstring; `TorchTrainer` builds it when its config names a critic."""

    def __init__(self, model: nn.Module, settings: CriticSettings, *, device: torch.device,
                 plan: Callable[[Sequence[TrainSample]], list[list[int]]], share_prompts: bool,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]], world_size: int,
                 betas: tuple[float, float], eps: float, weight_decay: float, grad_clip: float | None,
                 split: Callable[[PackedInputs], PackedInputs] = lambda inputs: inputs,
                 stats_group: Any = None) -> None:
        """`split`: the rank's part of a packed row under context parallelism (the trainer's); `stats_group`: the
        ranks whose step counts and metrics add up (the data-parallel ones; None: every rank)."""
        head = nn.Linear(model.config.get_text_config().hidden_size, 1, bias=False, device=device)
        nn.init.zeros_(head.weight)
        model.set_output_embeddings(head)
        model.config.tie_word_embeddings = False  # the values' head is not the embeddings' transpose
        self.model = model
        self.settings = settings
        self._device = device
        self._plan = plan
        self._share_prompts = share_prompts
        self._autocast = autocast
        self._world_size = world_size
        self._split = split
        self._stats_group = stats_group
        self._grad_clip = grad_clip if grad_clip is not None else float("inf")
        self._names = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
        self._optimizer = build_adam([p for p in model.parameters() if p.requires_grad], lr=settings.lr, betas=betas,
                                     eps=eps, weight_decay=weight_decay, stateless=settings.stateless_adam)
        self.steps = 0  # updates applied
        self.calls = 0  # updates attempted: the learner counts its critic-only warm-up in these

    def values(self, samples: Sequence[TrainSample]) -> Tensor:
        """Values of every response token, packed in sample order, on the CPU, without gradients."""
        if not samples:
            return torch.empty(0)
        self.model.eval()
        per_sample: list[Tensor | None] = [None] * len(samples)
        with torch.no_grad(), self._autocast():
            for members in self._plan(samples):
                inputs = self._split(pack_inputs([samples[i] for i in members], share_prompts=self._share_prompts)
                                     .to(self._device))
                values = self._token_values(inputs).cpu()
                for index, part in zip(members, values.split(inputs.response_lengths.tolist()), strict=True):
                    per_sample[index] = part
        return torch.cat([part for part in per_sample if part is not None])

    def reset_optimizer_state(self) -> None:
        """The critic's AdamW forgets its moments and step count (slime resets the critic's with the actor's)."""
        self._optimizer.state.clear()

    def train_step(self, samples: Sequence[TrainSample], loss: ValueLossFn, *, version: int) -> StepResult:
        """One critic update on `samples`; `version` is the policy's, reported unchanged."""
        started = time.perf_counter()
        self.calls += 1
        self.model.train()
        self._optimizer.zero_grad(set_to_none=True)
        stats = StepStats()
        plan = self._plan(samples)
        for members in plan:
            chunk = [samples[i] for i in members]
            inputs = self._split(pack_inputs(chunk, share_prompts=self._share_prompts).to(self._device))
            with self._autocast():
                predicted = self._token_values(inputs)
                value, metrics = loss(predicted, collate(chunk, self._device))
            check_loss(value)
            value.backward()
            stats.add(value, metrics)
        loss_sum, nonfinite, metric_sums, tokens = self._summed(stats, samples)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._grad_clip))
        reason = skip_reason(nonfinite, loss_sum, grad_norm, loss_tokens=tokens)
        if reason is None:
            self._optimizer.step()
            self.steps += 1
        self._optimizer.zero_grad(set_to_none=True)
        return step_result(version, metric_sums, loss=loss_sum, lr=self.settings.lr, grad_norm=grad_norm,
                           loss_tokens=tokens, sequences=len(samples), micro_batches=len(plan), started=started,
                           skip_reason=reason)

    def _token_values(self, inputs: PackedInputs) -> Tensor:
        """The value of every response token of the micro-batch (a context-parallel rank computes its own and
        gathers its group's)."""
        values = forward_packed(self.model, inputs)[:, 0].float()
        return values if inputs.context_row is None else inputs.context_row.join_tokens(values)

    def save(self, directory: Path, *, keep_optimizer: bool = True) -> None:
        """Weights, optimizer moments and step count under `directory` (a trainer checkpoint's staging folder);
        without `keep_optimizer`, no moments (a resumed critic starts a fresh optimizer)."""
        directory.mkdir(parents=True, exist_ok=True)
        save_model(self.model, str(directory / checkpoint.WEIGHTS_FILE))
        meta = checkpoint.save_optimizer(directory / checkpoint.OPTIMIZER_FILE, self._optimizer, self._names,
                                         keep_optimizer)
        checkpoint.write_state(directory, {"steps": self.steps, "calls": self.calls, "optimizer": meta,
                                           "settings": self.settings.model_dump(mode="json")})

    def load(self, directory: Path) -> None:
        """What `save` wrote; a checkpoint without a critic is refused by name (it cannot resume PPO exactly)."""
        if not (directory / checkpoint.WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{directory.parent}: checkpoint has no critic ({directory.name}/"
                                    f"{checkpoint.WEIGHTS_FILE}); it was written by a run without one")
        state = checkpoint.read_state(directory)
        missing, unexpected = load_model(self.model, str(directory / checkpoint.WEIGHTS_FILE), strict=False,
                                         device=str(self._device))
        if missing or unexpected:
            raise ValueError(f"{directory}: critic weights do not match this critic (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
        checkpoint.load_optimizer(directory / checkpoint.OPTIMIZER_FILE, self._optimizer, self._names,
                                  state["optimizer"])
        self.steps, self.calls = int(state["steps"]), int(state["calls"])

    def _summed(self, stats: StepStats, samples: Sequence[TrainSample]) -> tuple[float, bool, dict[str, float], int]:
        """The step's loss, metrics and trained tokens over every rank, and the gradients summed over ranks."""
        tokens = sum(int((s.loss_mask != 0).sum()) if s.loss_mask is not None else s.response_length
                     for s in samples)
        if self._world_size == 1:
            return stats.loss_sum, stats.nonfinite, stats.metric_sums, tokens
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
        keys = sorted(stats.metric_sums)
        summed = torch.tensor([stats.loss_sum, float(stats.nonfinite), float(tokens),
                               *(stats.metric_sums[key] for key in keys)], dtype=torch.float64, device=self._device)
        dist.all_reduce(summed, group=self._stats_group)
        values = summed.cpu().tolist()
        return values[0], values[1] > 0, dict(zip(keys, values[3:], strict=True)), int(values[2])
