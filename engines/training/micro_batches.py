"""Sequence packing: micro-batches by token budget, one padding-free row per micro-batch.

A micro-batch is ONE row: the samples' tokens concatenated, `position_ids` restarting at 0 for each sample
and no attention mask. The attention implementation turns the restarts into sequence boundaries: our
`packed_sdpa` and flash-attention's varlen path attend within each sequence only, and transformers' own
sdpa/eager build a block-diagonal causal mask. Either way no token attends across samples and nothing is
spent on padding. That contract is implicit, and a model that ignores it would silently mix samples, so
`check_packing_isolation` verifies it on the live model at start-up. `use_cache=False` is not optional: with a
cache object present transformers skips the packed-sequence detection.

With `share_prompts` (the torch trainer's default under `packed_sdpa`), the members of a group that follow
each other in the row share one copy of their prompt: a member after the first contributes its response alone,
positioned as if after the prompt. And the tokens every prompt of the micro-batch starts with (a system prompt,
a few-shot preamble) open the row once, each group's prompt continuing after them. Prompt tokens then run once
per group, a common preamble once per micro-batch, with the same logits and gradients (`check_packing_isolation`
checks both at start-up).

Only the logits that predict response tokens are computed (`logits_to_keep` with explicit positions): with a
150k vocabulary the prompt's logits would otherwise dominate memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engines.training import attention
from engines.training.base import TOKEN_FIELDS, PackedBatch, TrainSample
from engines.vision.processor import VisionInputs

# A preamble all prompts of a micro-batch share opens the row once when it is at least this long.
MIN_SHARED_PREFIX = 8


@dataclass(frozen=True)
class PackedInputs:
    """Model inputs of one micro-batch and where its response tokens sit in the row."""

    input_ids: Tensor  # [1, T]
    position_ids: Tensor  # [1, T]
    logit_positions: Tensor  # [N]: row positions whose logits predict the N response tokens
    targets: Tensor  # [N]: the response tokens themselves
    response_lengths: Tensor  # [B]
    # [sum of len(tokens)]: the row position that computes each token of each sample, samples one after another
    # (a prompt packed once serves every sample of its group from the same positions); only when asked for
    token_positions: Tensor | None = None
    # where the row's runs of positions begin, read on the host while packing, so planning its attention on a
    # device reads nothing back (`attention.row_starts`)
    row_starts: attention.RowStarts | None = None
    # this rank's part of a row split across a context-parallel group (`context_parallel.split_row`): its attention
    # plan, and how its response tokens' outputs rejoin the micro-batch's
    context_row: attention.RowPlan | None = None
    # a vision-language model's row: its samples' images in row order, and the 3-D rotary positions [3, 1, T] the
    # model reads beside the text positions (`engines.training.vision`)
    vision: VisionInputs | None = None
    rope_positions: Tensor | None = None

    def to(self, device: torch.device | str) -> PackedInputs:
        return PackedInputs(*(_to(value, device) for value in self.__dict__.values()))


def _to(value: object, device: torch.device | str) -> object:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, VisionInputs):
        return VisionInputs(value.pixel_values.to(device), value.grid_thw.to(device), value.tokens_per_image)
    return value


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into as few micro-batches of at most `token_budget` tokens as first-fit decreasing
    finds, then spread the samples evenly over that many micro-batches.

    The count decides the number of forward passes; the balance decides the peak activation memory and, with
    data parallelism, how long ranks wait for each other. Balancing uses longest-first onto the least-loaded
    micro-batch that still has room; if that ever fails to fit, the first-fit plan is kept. A sample longer
    than the budget gets a micro-batch to itself. Indices inside a micro-batch are ascending (deterministic).
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    first_fit = _first_fit(order, lengths, token_budget)
    balanced = _least_loaded(order, lengths, token_budget, len(first_fit))
    return [sorted(members) for members in (balanced or first_fit)]


def plan_shared_micro_batches(samples: Sequence[TrainSample], token_budget: int) -> list[list[int]]:
    """`plan_micro_batches` for rows packed with `share_prompts`: a run of neighbours with one prompt (a group)
    stays together where the budget allows and is counted as its prompt once plus its responses; a run too long
    for the budget is cut into pieces that each fit (each piece carries the prompt again)."""
    units: list[list[int]] = []
    unit_tokens: list[int] = []
    previous: Tensor | None = None
    for index, sample in enumerate(samples):
        prompt = sample.tokens[: sample.prompt_length]
        fits = bool(units) and unit_tokens[-1] + sample.response_length <= token_budget
        if previous is not None and fits and torch.equal(previous, prompt):
            units[-1].append(index)
            unit_tokens[-1] += sample.response_length
        else:
            units.append([index])
            unit_tokens.append(int(sample.tokens.numel()))
        previous = prompt
    plan = plan_micro_batches(unit_tokens, token_budget)
    return [sorted(index for unit in members for index in units[unit]) for members in plan]


def _first_fit(order: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    free: list[int] = []
    for index in order:
        target = next((b for b, room in enumerate(free) if room >= lengths[index]), None)
        if target is None:
            bins.append([index])
            free.append(budget - lengths[index])
        else:
            bins[target].append(index)
            free[target] -= lengths[index]
    return bins


def _least_loaded(order: list[int], lengths: Sequence[int], budget: int, count: int) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for index in order:
        fitting = [b for b in range(count) if loads[b] + lengths[index] <= budget or not bins[b]]
        if not fitting:
            return None
        target = min(fitting, key=lambda b: (loads[b], b))
        bins[target].append(index)
        loads[target] += lengths[index]
    return bins


def pack_inputs(samples: Sequence[TrainSample], *, share_prompts: bool = False,
                with_token_positions: bool = False) -> PackedInputs:
    """Concatenate samples into one row with per-sample positions; see the module docstring.
    `with_token_positions` also lists where each sample's every token sits (MoE routing replay reads it; it costs
    about half again the packing time, so other rows go without).

    With `share_prompts`, the prefix all prompts share (at least MIN_SHARED_PREFIX tokens, leaving each prompt one
    of its own) opens the row once and every sequence continues after it; and a sample whose prompt tokens equal
    those of the sequence just before it in the row (the next member of the same group) contributes only its
    response, positioned after the prompt. Only an attention that reads such continuations (`packed_sdpa`) may be
    given this row.
    """
    if not samples:
        raise ValueError("pack_inputs needs at least one sample")
    vision = VisionInputs.join([sample.vision for sample in samples if sample.vision is not None])
    if share_prompts and vision is not None:
        raise ValueError("pack_inputs: samples with images are packed without shared prompts (equal tokens may hold "
                         "different images; engines.training.vision)")
    # Built as Python lists and turned into tensors once: a few tensor ops per sample cost more than the rest of
    # the packing on an RL batch of hundreds of short samples (7 ms of a CPU step).
    token_lists = [sample.tokens.tolist() for sample in samples]
    prompts = [tokens[: sample.prompt_length] for tokens, sample in zip(token_lists, samples, strict=True)]
    shared = shared_prefix_length(prompts) if share_prompts else 0
    ids: list[int] = prompts[0][:shared]
    positions: list[int] = list(range(shared))
    logit_positions: list[int] = []
    targets: list[int] = []
    token_positions: list[int] = []
    root: tuple[int, list[int]] | None = None  # where the sequence a sample may continue sits, and its prompt
    for sample, tokens, prompt in zip(samples, token_lists, prompts, strict=True):
        prompt_length, response_length = sample.prompt_length, sample.response_length
        response = tokens[prompt_length:]
        offset = len(ids)
        if with_token_positions:
            token_positions += range(shared)
        if share_prompts and root is not None and root[1] == prompt:
            ids += response
            positions += range(prompt_length, prompt_length + len(response))
            # The first response token is predicted from the prompt's last position, in the root sequence.
            predictors = [root[0] + prompt_length - shared - 1, *range(offset, offset + response_length - 1)]
            logit_positions += predictors[:response_length]
            if with_token_positions:
                token_positions += range(root[0], root[0] + prompt_length - shared)
                token_positions += range(offset, offset + response_length)
        else:
            root = (offset, prompt)
            ids += tokens[shared:]
            positions += range(shared, len(tokens))
            start = offset + prompt_length - shared - 1
            logit_positions += range(start, start + response_length)
            if with_token_positions:
                token_positions += range(offset, offset + len(tokens) - shared)
        targets += response
    position_ids = torch.tensor(positions, dtype=torch.long).unsqueeze(0)
    return PackedInputs(
        input_ids=torch.tensor(ids, dtype=torch.long).unsqueeze(0),
        position_ids=position_ids,
        logit_positions=torch.tensor(logit_positions, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        response_lengths=torch.tensor([sample.response_length for sample in samples], dtype=torch.long),
        token_positions=torch.tensor(token_positions, dtype=torch.long) if with_token_positions else None,
        row_starts=attention.row_starts(position_ids, len(positions)),
        vision=vision,
    )


def shared_prefix_length(prompts: Sequence[list[int]]) -> int:
    """How many leading tokens every prompt shares, leaving each one of its own (a response's first token is
    predicted from its prompt's last position, which must sit in its own sequence); 0 below MIN_SHARED_PREFIX."""
    if len(prompts) < 2:
        return 0
    limit = min(len(prompt) for prompt in prompts) - 1
    first = prompts[0]
    shared = next((column for column in range(limit) if any(p[column] != first[column] for p in prompts)), limit)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def collate(samples: Sequence[TrainSample], device: torch.device | str = "cpu") -> PackedBatch:
    """The loss-side view of `samples`: per-token fields concatenated.

    Every sample must carry the same fields, otherwise the packed tensors would misalign silently.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    expected = set(samples[0].present_fields())
    for index, sample in enumerate(samples):
        present = set(sample.present_fields())
        if present != expected:
            missing, extra = sorted(expected - present), sorted(present - expected)
            raise ValueError(f"sample {index}: fields differ from sample 0 (missing {missing}, unexpected {extra})")
    packed = {
        name: torch.cat([getattr(s, name) for s in samples]).to(device) for name in TOKEN_FIELDS if name in expected
    }
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.long, device=device)
    return PackedBatch(response_lengths=lengths, **packed)


def count_loss_tokens(samples: Sequence[TrainSample]) -> int:
    """Response tokens that carry loss: loss_mask != 0 where a mask is given, every response token otherwise."""
    total = 0
    for sample in samples:
        mask = sample.loss_mask
        total += sample.response_length if mask is None else int((mask != 0).sum())
    return total


def forward_packed(model: nn.Module, inputs: PackedInputs) -> Tensor:
    """Logits [N, V] at `inputs.logit_positions` of one packed row (the only way the trainer runs the model)."""
    extra = {}  # packed_sdpa's plan of the row, made once for every layer
    if inputs.context_row is not None:
        extra["packed_plan"] = inputs.context_row
    elif _attention_of(model) == attention.NAME:
        positions = inputs.position_ids
        extra["packed_plan"] = attention.RowPlan(positions, positions.shape[-1], positions.device,
                                                 inputs.row_starts)
    output = model(
        input_ids=inputs.input_ids,
        position_ids=_model_positions(model, inputs),
        use_cache=False,
        logits_to_keep=inputs.logit_positions,
        **extra,
        **_image_inputs(inputs),
    )
    return output.logits[0]


def _attention_of(model: nn.Module) -> str | None:
    """The language model's attention implementation (a vision-language model's nested text config holds it)."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "_attn_implementation", None)


def _model_positions(model: nn.Module, inputs: PackedInputs) -> Tensor:
    """The row's positions as the model reads them: a vision-language model takes the text positions (which mark
    the samples) stacked on its 3-D rotary ones, [4, 1, T]; a text-only row's rotary ones are its text positions."""
    rope = inputs.rope_positions
    if rope is None:
        config = getattr(getattr(model, "module", model), "config", None)  # under DDP, the wrapped model's
        if getattr(config, "vision_config", None) is None:
            return inputs.position_ids
        rope = inputs.position_ids.unsqueeze(0).expand(3, -1, -1)
    return torch.cat([inputs.position_ids.unsqueeze(0), rope])


def _image_inputs(inputs: PackedInputs) -> dict[str, Tensor]:
    if inputs.vision is None:
        return {}
    return {"pixel_values": inputs.vision.pixel_values, "image_grid_thw": inputs.vision.grid_thw}


def padded_fraction(lengths: Sequence[int], plan: Sequence[Sequence[int]]) -> float:
    """Share of a [micro-batches x longest micro-batch] grid that would be padding under `plan`.

    Packed rows are never padded here; this is what a fixed-shape backend would pay for the plan, and a
    measure of how evenly it spreads the tokens.
    """
    loads = [sum(lengths[i] for i in members) for members in plan]
    capacity = len(loads) * max(loads, default=0)
    return 0.0 if capacity == 0 else 1.0 - sum(loads) / capacity


def check_packing_isolation(
    model: nn.Module, device: torch.device | str, *, share_prompts: bool = False, tolerance: float = 1e-4
) -> None:
    """Raise unless sequences packed into one row get the logits they get alone.

    Catches models (or attention implementations) that do not turn restarting position_ids into a
    block-diagonal mask: training on such a model would leak attention across samples without any error. With
    `share_prompts`, two samples of one prompt packed as prompt + continuation must match too, and prompts that
    continue one preamble packed once.
    """
    vocab_size = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    first, second, reply = (torch.randint(0, vocab_size, (length,), generator=generator) for length in (6, 5, 3))
    rows = [[TrainSample(first, len(first) - 1), TrainSample(second, len(second) - 1)]]
    if share_prompts:  # the second sample's prompt again, with another response of another length
        rows[0].append(TrainSample(torch.cat([second[:1], reply]), len(reply)))
        # and two groups (the second of two samples) whose prompts open with one preamble, packed once before them
        preamble = torch.randint(0, vocab_size, (MIN_SHARED_PREFIX,), generator=generator)
        rows.append([TrainSample(torch.cat([preamble, first]), 2), TrainSample(torch.cat([preamble, first[:3]]), 2),
                     TrainSample(torch.cat([preamble, first[:1], reply]), 3)])
    with torch.no_grad():
        packed = torch.cat([forward_packed(model, pack_inputs(row, share_prompts=share_prompts).to(device))
                            for row in rows])
        alone = torch.cat([forward_packed(model, pack_inputs([sample]).to(device))
                           for row in rows for sample in row])
    difference = (packed.float() - alone.float()).abs().max().item()
    if not difference <= tolerance:
        shared = " or shared prompts" if share_prompts else ""
        raise RuntimeError(
            f"{type(model).__name__} with attn_implementation={model.config._attn_implementation!r} does not "
            f"isolate packed sequences{shared} (max logit difference {difference:.3g} > {tolerance}); use an "
            "attention implementation that honours packed position_ids (packed_sdpa, sdpa, eager, flash_attention_2)"
        )
