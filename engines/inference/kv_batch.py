"""A continuous batch's KV cache on top of an unmodified Hugging Face model.

HF models decode a rectangular batch: one cache tensor [rows, kv_heads, columns, head_dim] per layer. To let
requests leave and join at any step we keep the batch *left-padded*: every row's newest token sits in the
last column, a per-row attention mask hides the padding, and explicit position ids give each row its own
positions (so padding never shifts RoPE). Then

* a finished row leaves by an index-select on the batch dimension, after which leading columns that are
  padding in every remaining row are cut off (the columns are always `max(row lengths)`);
* a newly prefilled group joins by left-padding the narrower of the two caches and stacking the rows.

The model is never patched: we only hand it a `DynamicCache`, `attention_mask` and `position_ids`, which is
why any HF causal LM with full attention works (Llama, Qwen2, Qwen3, ...). Its layers keep spare columns
(`ReservedColumnsLayer`): transformers' own layer concatenates the whole cache every token, a quarter of a SmolLM2
decode step at 64 rows and 200 columns on a CPU; ours writes the new column in place. The cache goes in under the
name the model's `forward` declares: `cache` on current transformers (where `past_key_values` is deprecated, warns
on every forward, and goes in 5.40), `past_key_values` on older releases.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engines.inference.prefix_cache import CachedPast
from engines.inference.vision_rows import PrefillVision, PromptVision

# A prefix shared by every sequence of a prefill runs once when it is at least this long (below that, the extra
# forward costs more than the rows it saves).
MIN_SHARED_PREFIX = 8
# Spare columns a layer reserves when it (re)allocates: a quarter of its width, at least this many, so appending is
# amortised O(1) per token and the reserve costs at most a quarter more memory (plus this floor).
MIN_RESERVED_COLUMNS = 64


class ReservedColumnsLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare columns: a new token is written in
    place instead of concatenating the whole cache. Whoever replaces `keys`/`values` with other tensors (eviction,
    joining, a shared prefix expanded over rows) needs to do nothing: the next update sees they are not the views
    it handed out and moves them into new buffers. `expected_columns`: how wide a chunked prefill will make the layer,
    so its first buffer is sized for all of it (growing chunk by chunk would hold the old and the new buffer at once,
    each a copy of the whole cache)."""

    def __init__(self, expected_columns: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.expected_columns = expected_columns
        self._keys_view: torch.Tensor | None = None
        self._values_view: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        new = old + key_states.shape[-2]
        replaced = self.keys is not self._keys_view or self.values is not self._values_view
        if replaced or new > self._key_buffer.shape[-2]:
            self._move_into_buffers(key_states, value_states, old, new)
        self._key_buffer[:, :, old:new].copy_(key_states)
        self._value_buffer[:, :, old:new].copy_(value_states)
        self.keys = self._keys_view = self._key_buffer[:, :, :new]
        self.values = self._values_view = self._value_buffer[:, :, :new]
        return self.keys, self.values

    def _move_into_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor, old: int, new: int) -> None:
        wanted = max(new, self.expected_columns)
        capacity = wanted + max(MIN_RESERVED_COLUMNS, wanted // 4)
        rows, heads, _, head_dim = key_states.shape
        self._key_buffer = key_states.new_empty(rows, heads, capacity, head_dim)
        self._value_buffer = value_states.new_empty(rows, heads, capacity, value_states.shape[-1])
        if old:
            self._key_buffer[:, :, :old].copy_(self.keys)
            self._value_buffer[:, :, :old].copy_(self.values)


def _new_cache(expected_columns: int = 0) -> DynamicCache:
    cache = DynamicCache()
    # the layers are made on the first forward's updates
    cache.layer_class_to_replicate = functools.partial(ReservedColumnsLayer, expected_columns)
    return cache


class KVBatch:
    """The running rows' cache, mask and next positions; row order is the caller's row order."""

    def __init__(self, cache: DynamicCache | None, attention_mask: torch.Tensor, next_positions: torch.Tensor) -> None:
        self.cache = cache
        self.attention_mask = attention_mask  # [rows, columns] int64, 1 = real token
        self.next_positions = next_positions  # [rows] int64, position id of each row's next token

    @classmethod
    def empty(cls, device: torch.device) -> KVBatch:
        return cls(
            None,
            torch.zeros(0, 0, dtype=torch.int64, device=device),
            torch.zeros(0, dtype=torch.int64, device=device),
        )

    @property
    def rows(self) -> int:
        return self.attention_mask.shape[0]

    @property
    def columns(self) -> int:
        return self.attention_mask.shape[1]

    @classmethod
    def prefill(cls, model: nn.Module, sequences: list[list[int]], pad_token_id: int, *,
                share_prefix: bool = True, past: CachedPast | None = None,
                chunk_tokens: int | None = None) -> tuple[KVBatch, torch.Tensor]:
        """Run the sequences through the model, left-padded; returns the batch and its last logits.

        The logits ([rows, vocab]) are those after each sequence's final token, i.e. the distribution of the
        next token; the batch caches every token of every sequence.

        With `share_prefix`, the tokens every sequence starts with (a system prompt, a few-shot preamble, the chat
        template's head) run once, in a forward of their own, and the rest of each sequence attends to that one
        copy: a row then holds [shared prefix][padding][own tokens], which the mask and the explicit positions
        already describe, so decoding, eviction and joining read it like any left-padded row.

        With `past` (keys and values of each row's leading tokens, from the prefix cache), `sequences[i]` are the
        tokens that follow row i's past, and only they run: row i holds [padding][past][padding][own tokens]. The
        caller that wants rows without padding inside them (the static pool) gives every row with a past as many own
        tokens as the widest.

        `chunk_tokens` bounds each forward (`ChunkedPrefill`); None runs the whole prefill in one.
        """
        run = ChunkedPrefill(model, sequences, pad_token_id, share_prefix=share_prefix, past=past,
                             chunk_tokens=chunk_tokens)
        while not run.done:
            run.advance()
        return run.result()

    def decode(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([rows] int64) and return the next-token logits [rows, vocab]."""
        ones = torch.ones((self.rows, 1), dtype=self.attention_mask.dtype, device=self.attention_mask.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=-1)
        output = model(
            input_ids=input_ids.unsqueeze(-1),
            attention_mask=self.attention_mask,
            position_ids=self.next_positions.unsqueeze(-1),
            use_cache=True,
            **{_cache_argument(model): self.cache},
        )
        self.next_positions = self.next_positions + 1
        return output.logits[:, -1, :]

    def select(self, rows: torch.Tensor) -> None:
        """Keep `rows` (int64 indices into the current rows, in the new order; repeats allowed).

        Repeats are how n samples of one prompt get their own copy of a prompt prefilled once.
        """
        if rows.numel() == 0:
            self.cache = None
            self.attention_mask = self.attention_mask[:0, :0]
            self.next_positions = self.next_positions[:0]
            return
        mask = self.attention_mask.index_select(0, rows)
        first = int(mask.any(dim=0).to(torch.int8).argmax())  # leading columns that are padding in every row
        self.attention_mask = mask[:, first:]
        self.next_positions = self.next_positions.index_select(0, rows)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, rows)[:, :, first:]
            layer.values = layer.values.index_select(0, rows)[:, :, first:]

    def extend(self, other: KVBatch) -> None:
        """Append `other`'s rows after ours, left-padding whichever cache is narrower."""
        if other.rows == 0:
            return
        if self.rows == 0:
            self.cache, self.attention_mask = other.cache, other.attention_mask
            self.next_positions = other.next_positions
            return
        columns = max(self.columns, other.columns)
        self.attention_mask = _stack_right_aligned(self.attention_mask, other.attention_mask, columns)
        self.next_positions = torch.cat([self.next_positions, other.next_positions])
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys = _stack_right_aligned(mine.keys, theirs.keys, columns)
            mine.values = _stack_right_aligned(mine.values, theirs.values, columns)

    def _layers(self) -> list:
        return [] if self.cache is None else list(self.cache.layers)


@dataclass(frozen=True)
class PrefillForward:
    """One forward of a `ChunkedPrefill`: `rows` x `columns` input tokens, `tokens` of them real (not padding);
    `shared` when it ran the prefix every row shares (one row, no routes of its own rows)."""

    rows: int
    columns: int
    tokens: int
    shared: bool


class ChunkedPrefill:
    """`KVBatch.prefill` as a series of forwards of at most `chunk_tokens` input tokens (rows x columns) each, run one
    `advance()` at a time, so a caller can do other work (decode steps) between them.

    The padded [rows, width] input is cut into column ranges; each forward appends its columns' keys and values to the
    cache and attends to every earlier column through it, with the same mask and positions the whole forward would
    use, so the result is the one-forward prefill's up to float rounding (attention reduces over another split of
    the same keys). Only the last forward's last logits are kept. What a forward holds in activations is then bounded
    by the chunk (attention over the cache grows with the columns before it); the cache itself is allocated once at
    its final width. A forward is never narrower than one column, so with more rows than `chunk_tokens` it runs one
    column of every row."""

    def __init__(self, model: nn.Module, sequences: list[list[int]], pad_token_id: int, *,
                 share_prefix: bool = True, past: CachedPast | None = None, chunk_tokens: int | None = None,
                 vision: Sequence[PromptVision | None] | None = None) -> None:
        """`vision`: each sequence's images (None for a text row); rows with images run in one forward (an image's
        features fill all of its tokens at once), share no prefix and take no cached past (`vision_rows.py`)."""
        if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
            raise ValueError(f"ChunkedPrefill: chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")
        with_images = vision is not None and any(row is not None for row in vision)
        if with_images:
            if past is not None:
                raise ValueError("ChunkedPrefill: rows with images take no cached past")
            share_prefix, chunk_tokens = False, None
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.rows = len(sequences)
        device = model.device
        if past is not None:
            self.prefix: list[int] = []
            prior = past.columns
            past_lengths = torch.tensor(past.lengths, dtype=torch.int64)
            past_mask = (torch.arange(prior).unsqueeze(0) >= prior - past_lengths.unsqueeze(1)).to(torch.int64)
            suffixes = sequences
        else:
            shared = _shared_prefix_length(sequences) if share_prefix else 0
            self.prefix = sequences[0][:shared]
            prior = shared
            past_lengths = torch.full((self.rows,), shared, dtype=torch.int64)
            past_mask = torch.ones((self.rows, shared), dtype=torch.int64)
            suffixes = [sequence[shared:] for sequence in sequences]
        self.width = max(len(suffix) for suffix in suffixes)
        self.prior = prior
        self.cache = _new_cache(prior + self.width)
        if past is not None:
            for keys, values in zip(past.keys, past.values, strict=True):
                layer = ReservedColumnsLayer(prior + self.width)
                layer.update(keys, values)
                self.cache.layers.append(layer)
        input_ids = torch.full((self.rows, self.width), pad_token_id, dtype=torch.int64)
        own_mask = torch.zeros((self.rows, self.width), dtype=torch.int64)
        for row, suffix in enumerate(suffixes):
            input_ids[row, self.width - len(suffix) :] = torch.tensor(suffix, dtype=torch.int64)
            own_mask[row, self.width - len(suffix) :] = 1
        self.input_ids, own_mask = input_ids.to(device), own_mask.to(device)
        self.position_ids = (own_mask.cumsum(dim=-1) - 1).clamp_(min=0) + past_lengths.to(device).unsqueeze(1)
        self.attention_mask = torch.cat([past_mask.to(device), own_mask], dim=-1)
        self.vision = (PrefillVision.build(vision, [len(suffix) for suffix in suffixes], self.width, device)
                       if with_images and vision is not None else None)
        self.prefix_done = 0  # shared-prefix tokens run
        self.columns_done = 0  # own columns run
        self._logits: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self._logits is not None

    @property
    def forwards_left(self) -> int:
        """How many more `advance()` calls finish the prefill."""
        prefix_step = self.chunk_tokens or len(self.prefix) or 1
        columns_step = self._columns_per_forward()
        return (-(-(len(self.prefix) - self.prefix_done) // prefix_step)
                + -(-(self.width - self.columns_done) // columns_step))

    def advance(self) -> PrefillForward:
        """Run the next forward (the shared prefix's first, then the rows' own columns)."""
        if self.done:
            raise RuntimeError("ChunkedPrefill.advance: the prefill is done")
        argument = _cache_argument(self.model)
        if self.prefix_done < len(self.prefix):
            start = self.prefix_done
            end = len(self.prefix) if self.chunk_tokens is None else min(len(self.prefix), start + self.chunk_tokens)
            device = self.input_ids.device
            self.model(input_ids=torch.tensor([self.prefix[start:end]], device=device),
                       position_ids=torch.arange(start, end, device=device).unsqueeze(0), use_cache=True,
                       logits_to_keep=1, **{argument: self.cache})
            self.prefix_done = end
            if end == len(self.prefix):  # one copy, seen by every row; the next update moves it into row buffers
                for layer in self.cache.layers:
                    layer.keys = layer.keys.expand(self.rows, -1, -1, -1)
                    layer.values = layer.values.expand(self.rows, -1, -1, -1)
            return PrefillForward(1, end - start, end - start, shared=True)
        start = self.columns_done
        end = min(self.width, start + self._columns_per_forward())
        rows_inputs = ({"position_ids": self.position_ids[:, start:end]} if self.vision is None
                       else self.vision.forward_inputs(self.model))  # one forward: the whole width
        output = self.model(
            input_ids=self.input_ids[:, start:end],
            attention_mask=self.attention_mask[:, : self.prior + end],
            use_cache=True,
            logits_to_keep=1,
            **rows_inputs,
            **{argument: self.cache},
        )
        self.columns_done = end
        if end == self.width:
            self._logits = output.logits[:, -1, :]
        tokens = int(self.attention_mask[:, self.prior + start : self.prior + end].sum())
        return PrefillForward(self.rows, end - start, tokens, shared=False)

    def result(self) -> tuple[KVBatch, torch.Tensor]:
        if self._logits is None:
            raise RuntimeError("ChunkedPrefill.result: the prefill has forwards left")
        next_positions = self.attention_mask.sum(dim=-1) if self.vision is None else self.vision.next_positions
        return KVBatch(self.cache, self.attention_mask, next_positions), self._logits

    def _columns_per_forward(self) -> int:
        return self.width if self.chunk_tokens is None else max(1, self.chunk_tokens // self.rows)


def _shared_prefix_length(sequences: list[list[int]]) -> int:
    """How many leading tokens all `sequences` share, leaving each at least one of its own (the forward over the
    rest must produce each row's last logits); 0 when that is below MIN_SHARED_PREFIX or there is one sequence."""
    if len(sequences) < 2:
        return 0
    limit = min(len(sequence) for sequence in sequences) - 1
    first = sequences[0]
    shared = next((column for column in range(limit) if any(s[column] != first[column] for s in sequences)), limit)
    return shared if shared >= MIN_SHARED_PREFIX else 0


@functools.cache
def _cache_argument_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _cache_argument(model: nn.Module) -> str:
    """The keyword `model.forward` takes its KV cache by: `cache` on current transformers, `past_key_values` on
    older releases (which would swallow an unknown `cache` into **kwargs and silently decode without it)."""
    return _cache_argument_of(type(model))


def _stack_right_aligned(first: torch.Tensor, second: torch.Tensor, columns: int) -> torch.Tensor:
    """Stack on dim 0, each input right-aligned in `columns` (dim 2 for KV tensors, dim 1 for masks); zero pad.

    One allocation and two copies, instead of padding both and concatenating (three allocations).
    """
    column_dim = 1 if first.dim() == 2 else 2
    shape = list(first.shape)
    shape[0] = first.shape[0] + second.shape[0]
    shape[column_dim] = columns
    stacked = first.new_zeros(shape)
    stacked[: first.shape[0]].narrow(column_dim, columns - first.shape[column_dim], first.shape[column_dim]).copy_(
        first
    )
    stacked[first.shape[0] :].narrow(column_dim, columns - second.shape[column_dim], second.shape[column_dim]).copy_(
        second
    )
    return stacked
