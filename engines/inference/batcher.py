"""The synchronous heart of the torch engine: admit, prefill, decode, stop, evict, one step at a time.

`ContinuousBatcher` owns the waiting queue, the running rows and their `KVBatch`. One `step()` decodes one
token for every running row, admits waiting samples into the freed slots (prefilling them in a second
forward, which also samples their first token), then evicts the rows that finished. A short request
therefore leaves as soon as it is done and a waiting one takes its slot the very next step, instead of
the whole batch waiting for its longest member as `model.generate()` does.

A prefill longer than `BatchLimits.prefill_chunk_tokens` runs as chunks, one forward per step, between the running
rows' decode steps (SGLang's chunked prefill does the same): a 16k-token prompt neither takes memory in proportion to
its whole length in one forward nor stalls every running row for the seconds that forward takes. Its rows join the
batch at the step of their last chunk, which also samples their first token.

It knows nothing about threads, futures or versions beyond the number it is told to stamp on the tokens of
a step: the engine (`torch_engine.py`) drives it from its decode thread and applies control commands
between steps.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from engines.inference.batch_invariant import sample_padded_rows
from engines.inference.cached_prefixes import CachedPrefixes, real_columns
from engines.inference.decoding_sequence import DecodingSequence, append_tokens
from engines.inference.kv_batch import ChunkedPrefill, KVBatch
from engines.inference.min_new_tokens import hold_back_stops
from engines.inference.multi_lora import MultiLora
from engines.inference.prefix_cache import PrefixCache, PrefixMatch
from engines.inference.sampling import RowParams, sample_next_tokens
from engines.inference.vision_rows import PromptVision
from engines.training.moe import RoutedLayer, Routers

# Byte-level tokenizers may spend up to 4 tokens on one character, so a stop string of k characters can
# span up to 4k tokens; decoding that many trailing tokens is enough to see any match the newest token made.
TOKENS_PER_CHARACTER_BOUND = 4


@dataclass(frozen=True)
class BatchLimits:
    """Bounds on the batch; the KV budget is what bounds memory.

    `max_batch_tokens` bounds rows x columns of the padded KV cache *in the worst case*: a sample is
    admitted only if, with every running sample grown to its full `prompt + max_new_tokens`, the cache
    still fits. So the cache never outgrows the budget and nothing is ever preempted.
    `max_prefill_tokens` bounds the padded size (rows x widest row) of the samples admitted at once, except that one
    sample is always admitted when nothing runs.
    `prefill_chunk_tokens` bounds the padded input of one prefill forward (rows x columns), which is what bounds a
    prefill's activations: a longer prefill runs chunk by chunk, one chunk per step (a forward is never narrower
    than one column of every row).
    """

    max_batch_size: int = 64
    max_batch_tokens: int = 131_072
    max_prefill_tokens: int = 16_384
    prefill_chunk_tokens: int = 8_192

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "max_prefill_tokens", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchLimits.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class StepRecord:
    """What one step did, for metrics, tracing and tests of the batching itself."""

    step: int
    version: int
    decoded: tuple[tuple[str, int], ...]  # (request_id, sample_index) of rows decoded this step
    admitted: tuple[tuple[str, int], ...]  # rows prefilled and joined this step
    finished: tuple[tuple[str, int], ...]  # rows that left after this step
    rows: int  # running rows after the step
    columns: int  # KV cache columns after the step
    prefilling: tuple[tuple[str, int], ...] = ()  # rows whose chunked prefill ran a chunk and goes on next step


@dataclass
class _PieceRun:
    """Sequences prefilled in one series of forwards (a piece, `ContinuousBatcher._pieces`), with what each takes from
    the prefix cache and the routes its forwards recorded so far ([rows, columns, layers, k] per forward)."""

    sequences: list[list[int]]
    adapters: list[str | None]
    used: list[PrefixMatch]
    past_routes: list[torch.Tensor | None]
    prefill: ChunkedPrefill
    routes: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Prefilling:
    """Samples admitted whose prefill is in progress: `forwards` runs one more forward per `next()` (yielding the
    tokens it computed) and finally returns their cache and next-token logits."""

    samples: list[DecodingSequence]
    forwards: Generator[int, None, tuple[KVBatch, torch.Tensor]]
    computed_tokens: int = 0  # by the forwards that ran so far


@dataclass(frozen=True)
class StepResult:
    finished: list[DecodingSequence]
    new_tokens: int
    record: StepRecord


class ContinuousBatcher(CachedPrefixes):
    """Continuous batching over one HF causal LM; not thread-safe (one decode thread drives it)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase | None,
        limits: BatchLimits,
        rng: torch.Generator,
        pad_token_id: int = 0,
        batch_invariant: bool = False,
        record_routes: bool = False,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """`batch_invariant`: the model was made batch-invariant (`batch_invariant.make_batch_invariant`); then each
        distinct sequence is prefilled on its own and sampling sees padded rows, so a row's tokens and log-probs
        do not depend on the rows beside it either. `record_routes`: an MoE model's samples carry the experts each
        of their tokens was routed to (rollout routing replay). `prefix_cache`: keys and values kept across requests
        (`prefix_cache.py`); a prefill takes what it holds of a sequence and computes the rest."""
        self.model = model
        self.batch_invariant = batch_invariant
        self.tokenizer = tokenizer
        self.limits = limits
        self.rng = rng
        self.pad_token_id = pad_token_id
        self.share_prefix = True  # prefill a prefix every admitted sequence shares once (kv_batch.py)
        self.routers = Routers(model, wanted_by="recording routed experts") if record_routes else None
        if self.routers is not None:  # one forward per prefill, whose rows hold each sequence's tokens whole
            self.share_prefix = False
        self.device = next(model.parameters()).device
        self.waiting: deque[DecodingSequence] = deque()
        self.running: list[DecodingSequence] = []
        self.prefilling: _Prefilling | None = None  # admitted, not running yet: their prefill has chunks to go
        self.kv = KVBatch.empty(self.device)
        self.steps = 0
        # Tokens sampled from a cache row whose oldest keys/values an older weight version computed: zero when
        # the engine drops the cache at every update (`drop_cache`), the count of off-policy tokens otherwise.
        self.stale_kv_tokens = 0
        self.prefix_cache = prefix_cache
        # Every weight load is an epoch (`weights_loaded`), a repush of the same version included: the prefix cache
        # reuses keys and values of the epoch they were computed in only. `weights_epoch` is the base weights' newest,
        # `adapter_epochs` each named adapter's.
        self.loads = 0
        self.weights_epoch = 0
        self.adapter_epochs: dict[str, int] = {}
        self.reprefilled_tokens = 0  # in-flight tokens prefilled again after an update dropped their rows
        # Adapters served unmerged, each row's forward with its sample's adapter (the engine sets it at its first
        # named adapter). Rows with an adapter bypass the shared-prefix forward (one set of weights computes its
        # keys and values for every row) and use the adapter's own part of the prefix cache.
        self.adapters: MultiLora | None = None
        # Each named adapter's policy version, which its rows' tokens carry (the engine sets it at each load of it). A
        # row whose adapter has not been loaded yet runs on the base weights, which is what a fresh adapter (LoRA
        # B = 0) computes, and its tokens carry version 0.
        self.adapter_versions: dict[str, int] = {}
        # Tokens never sampled (a vision-language model's image placeholders: vision_rows.placeholder_tokens)
        self.held_back_tokens: torch.Tensor | None = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def in_flight(self) -> list[DecodingSequence]:
        """Every sample not finished yet: running, prefilling and waiting."""
        return [*self.running, *(self.prefilling.samples if self.prefilling else ()), *self.waiting]

    def add(self, samples: list[DecodingSequence]) -> None:
        self.waiting.extend(samples)

    def adapter_unloaded(self, adapter: str) -> None:
        self.adapter_versions.pop(adapter, None)
        self.adapter_epochs.pop(adapter, None)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(adapter)

    def adapter_version(self, adapter: str | None, version: int) -> int:
        """The policy version of the weights a row of `adapter` decodes with: `version` (the base weights') when it
        has none."""
        return version if adapter is None else self.adapter_versions.get(adapter, 0)

    def step(self, version: int) -> StepResult:
        decoded = list(self.running)
        self.stale_kv_tokens += sum(sample.kv_version != self.adapter_version(sample.adapter, version)
                                    for sample in decoded)
        if decoded:
            self._decode(decoded, version)
        admitted = self._prefill_step(version)
        self.running.extend(admitted)
        finished = [sample for sample in self.running if self._check_stop(sample)]
        if finished:
            self._evict(lambda sample: sample.finish_reason is not None)
        self.steps += 1
        record = StepRecord(
            step=self.steps,
            version=version,
            decoded=tuple(sample.key for sample in decoded),
            admitted=tuple(sample.key for sample in admitted),
            finished=tuple(sample.key for sample in finished),
            rows=len(self.running),
            columns=self.cache_columns,
            prefilling=tuple(sample.key for sample in self.prefilling.samples) if self.prefilling else (),
        )
        return StepResult(finished=finished, new_tokens=len(decoded) + len(admitted), record=record)

    def abort(self, request_ids: set[str] | None) -> list[DecodingSequence]:
        """Remove the samples of `request_ids` (all with None), mark them aborted and return them."""

        def doomed(sample: DecodingSequence) -> bool:
            return request_ids is None or sample.request_id in request_ids

        if self.prefilling is not None and any(doomed(sample) for sample in self.prefilling.samples):
            self._requeue_prefilling()  # the others start their prefill over
        aborted = [sample for sample in self.waiting if doomed(sample)]
        self.waiting = deque(sample for sample in self.waiting if not doomed(sample))
        aborted += self._evict(doomed)
        for sample in aborted:
            sample.finish("abort")
        return aborted

    def reset(self) -> list[DecodingSequence]:
        """Abandon everything (after a failed step, when the cache may be half-updated); returns the samples."""
        self._requeue_prefilling()
        dropped = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        self._clear_cache()
        self.release_prefix_cache()  # a failed step may have left it half-written too
        for sample in dropped:
            sample.finish("abort")
        return dropped

    def drop_cache(self) -> None:
        """Forget the KV cache (it was computed by old weights); running samples are re-prefilled first.

        They go back to the front of the queue with their outputs so far, so the next step recomputes their
        cache with the current weights and samples their next token from it. They were admitted already,
        so they fit the budget again. A prefill in progress starts over behind them.
        """
        self._requeue_prefilling(new_weights=True)
        for sample in self.running:
            sample.kv_version = sample.kv_epoch = None
            dropped = len(sample.prompt_ids) + len(sample.output_ids) - 1
            sample.reprefilled_tokens += dropped
            self.reprefilled_tokens += dropped
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        self._clear_cache()

    def drop_adapter_rows(self, adapter: str) -> None:
        """`drop_cache` for the rows of one adapter, after a load of it: the others' keys and values came from weights
        it did not change, so they keep them."""
        if self.prefilling is not None and any(sample.adapter == adapter for sample in self.prefilling.samples):
            self._requeue_prefilling(new_weights=True)
        dropped = [sample for sample in self.running if sample.adapter == adapter]
        if not dropped:
            return
        for sample in dropped:
            sample.kv_version = sample.kv_epoch = None
            tokens = len(sample.prompt_ids) + len(sample.output_ids) - 1
            sample.reprefilled_tokens += tokens
            self.reprefilled_tokens += tokens
        if len(dropped) == len(self.running):
            self.running = []
            self._clear_cache()
        else:
            order = self._keep_rows([row for row, sample in enumerate(self.running) if sample.adapter != adapter])
            self.running = [self.running[row] for row in order]
        self.waiting.extendleft(reversed(dropped))

    # ----- the cache: what a batcher with another KV layout replaces (static_batcher.py) -----

    @property
    def cache_columns(self) -> int:
        return self.kv.columns

    def _clear_cache(self) -> None:
        self.kv = KVBatch.empty(self.device)

    def _decode(self, decoded: list[DecodingSequence], version: int) -> None:
        last_tokens = torch.tensor([sample.output_ids[-1] for sample in decoded], device=self.device)
        with self._tapped() as taps, self._adapter_rows([sample.adapter for sample in decoded]):
            logits = self.kv.decode(self.model, last_tokens)
        if taps:
            for sample, route in zip(decoded, _layers_last(taps).unsqueeze(1), strict=True):
                sample.routes.append(route)
        self._append_sampled(decoded, logits, version)

    def _tapped(self) -> contextlib.AbstractContextManager[list[RoutedLayer]]:
        return self.routers.tapped() if self.routers is not None else contextlib.nullcontext([])

    def _adapter_rows(self, adapters: list[str | None]) -> contextlib.AbstractContextManager[None]:
        """Forwards inside run row i with `adapters[i]`; an adapter not loaded yet is a fresh one, the base weights."""
        if self.adapters is None or not any(adapters):
            return contextlib.nullcontext()
        loaded = self.adapters
        return loaded.adapter_rows([name if name in loaded else None for name in adapters], self.device)

    def _prefill_step(self, version: int) -> list[DecodingSequence]:
        """Run the next forward of the prefill in progress, first starting one for the samples admitted now if none
        is; returns the samples whose prefill that forward finished, joined to the cache with their first token."""
        if self.prefilling is None:
            admitted = self._admit()
            if not admitted:
                return []
            self.prefilling = _Prefilling(admitted, self._prefill(admitted, version))
        prefilling = self.prefilling
        try:
            prefilling.computed_tokens += next(prefilling.forwards)
        except StopIteration as finished:
            self.prefilling = None
            batch, logits = finished.value
            self._join(prefilling.samples, batch, logits, version)
            return prefilling.samples
        return []

    def _requeue_prefilling(self, *, new_weights: bool = False) -> None:
        """Stop the prefill in progress and put its samples back at the front of the queue: what it computed so far
        is dropped (the weights it came from changed, one of its samples left, or a step failed). Under `new_weights`
        what it computed counts as prefilled again (`reprefilled_tokens`, the engine's count; the samples' own counts
        are of tokens they had in the cache)."""
        if self.prefilling is None:
            return
        prefilling, self.prefilling = self.prefilling, None
        prefilling.forwards.close()
        self.waiting.extendleft(reversed(prefilling.samples))
        if new_weights:
            self.reprefilled_tokens += prefilling.computed_tokens

    def _join(self, admitted: list[DecodingSequence], batch: KVBatch, logits: torch.Tensor, version: int) -> None:
        self.stale_kv_tokens += sum(sample.kv_version != self.adapter_version(sample.adapter, version)
                                    for sample in admitted)
        self._append_sampled(admitted, logits, version)
        self.kv.extend(batch)

    def _row_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the running rows' keys and values ([rows, kv_heads, columns, head_dim], row = running order)."""
        layers = self.kv._layers()
        return [layer.keys for layer in layers], [layer.values for layer in layers]

    def _row_columns(self, rows: list[int], counts: list[int]) -> list[torch.Tensor]:
        """The columns of each running row's cached tokens, in token order (`counts[i]` of them in row `rows[i]`)."""
        mask = self.kv.attention_mask.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self.device))
        return real_columns(mask, counts)

    def _keep_rows(self, keep: list[int]) -> list[int]:
        """Keep the cache rows `keep` (indices in the running order, ascending); returns the running rows' new
        order (indices in the old order)."""
        self.kv.select(torch.tensor(keep, dtype=torch.int64, device=self.device))
        return keep

    def admissible(self, sample: DecodingSequence) -> str | None:
        """Why `sample` can never run here, or None: the engine refuses it at submission instead."""
        if sample.worst_case_length > self.limits.max_batch_tokens:
            return (f"prompt ({len(sample.prompt_ids)}) + max_new_tokens ({sample.max_new_tokens}) exceeds the "
                    f"engine's max_batch_tokens={self.limits.max_batch_tokens}")
        return None

    def _fits(self, rows: int, columns: int) -> bool:
        """Whether `rows` rows of up to `columns` columns each fit the KV budget."""
        return rows * columns <= self.limits.max_batch_tokens

    def _admit(self) -> list[DecodingSequence]:
        limits = self.limits
        admitted: list[DecodingSequence] = []
        worst_columns = max((sample.worst_case_length for sample in self.running), default=0)
        prefill_width = 0
        while self.waiting and len(self.running) + len(admitted) < limits.max_batch_size:
            candidate = self.waiting[0]
            rows = len(self.running) + len(admitted) + 1
            columns = max(worst_columns, candidate.worst_case_length)
            width = max(prefill_width, self._uncached_length(candidate.prompt_ids + candidate.output_ids,
                                                             candidate.adapter))
            nothing_else = rows == 1
            if not nothing_else and not self._fits(rows, columns):
                break
            if admitted and (len(admitted) + 1) * width > limits.max_prefill_tokens:
                break
            admitted.append(self.waiting.popleft())
            worst_columns, prefill_width = columns, width
        return admitted

    def _prefill(self, admitted: list[DecodingSequence], version: int,
                 ) -> Generator[int, None, tuple[KVBatch, torch.Tensor]]:
        """Prefill each distinct token sequence once (n samples of a prompt share it), from where the prefix cache's
        copy of it ends; then fan rows out. Stamps each sample with the weights its keys and values depend on, keeps
        the sequences in the prefix cache, and returns the rows' cache and their next-token logits.

        A generator: each `next()` runs one forward of at most `prefill_chunk_tokens` tokens and yields the tokens it
        computed; the last one returns.
        Everything taken from the prefix cache is taken before the first forward (a later step's inserts may evict
        it), and the stamps are the weights at the start: under weights that change between chunks (keys and values
        kept across updates) a row's keys and values are as old as its first chunk's."""
        unique: dict[tuple[str | None, int, tuple[int, ...]], int] = {}
        sequences: list[list[int]] = []
        adapters: list[str | None] = []
        visions: list[PromptVision | None] = []
        expand: list[int] = []
        for sample in admitted:
            tokens = sample.prompt_ids + sample.output_ids
            key = (sample.adapter, id(sample.vision), tuple(tokens))  # one request's images: the same object
            if key not in unique:
                unique[key] = len(sequences)
                sequences.append(tokens)
                adapters.append(sample.adapter)
                visions.append(sample.vision)
            expand.append(unique[key])
        matches = [PrefixMatch() if vision is not None else self._cached(sequence, adapter)
                   for sequence, adapter, vision in zip(sequences, adapters, visions, strict=True)]
        row_versions = [self.adapter_version(adapter, version) for adapter in adapters]
        epochs = [self.epoch_of(adapter) for adapter in adapters]
        pieces = self._pieces(matches)
        runs = [self._start_piece([sequences[i] for i in piece], [matches[i] for i in piece],
                                  [adapters[i] for i in piece], [visions[i] for i in piece]) for piece in pieces]
        for position, run in enumerate(runs):
            while not run.prefill.done:
                tokens = self._advance(run)
                if not run.prefill.done or position < len(runs) - 1:
                    yield tokens
        batch, logits = KVBatch.empty(self.device), []
        rows = [0] * len(sequences)  # each sequence's row in `batch`
        used = [PrefixMatch()] * len(sequences)
        routes: list[torch.Tensor | None] = [None] * len(sequences)
        for piece, run in zip(pieces, runs, strict=True):
            part, part_logits = run.prefill.result()
            for offset, (index, part_routes) in enumerate(zip(piece, self._piece_routes(run), strict=True)):
                rows[index], used[index], routes[index] = batch.rows + offset, run.used[offset], part_routes
            batch.extend(part)
            logits.append(part_logits)
        stamps = [(row_version, epoch) if not taken.length else
                  (min(row_version, taken.version), min(epoch, taken.epoch))
                  for taken, row_version, epoch in zip(used, row_versions, epochs, strict=True)]
        for sample, index in zip(admitted, expand, strict=True):
            sample.kv_version, sample.kv_epoch = stamps[index]
            sample.cached_tokens += used[index].length
            sample.stale_cached_tokens += matches[index].stale
            if routes[index] is not None:
                sample.routes = [routes[index]]  # a prefill recomputes (or takes) every token's route so far
        if self.prefix_cache is not None:
            for sequence, match, taken in zip(sequences, matches, used, strict=True):
                self.prefix_cache.counters.prefilled(len(sequence), taken.length, match.stale)
            texts = [index for index, vision in enumerate(visions) if vision is None]  # vision_rows.py: why
            if texts:
                self._keep_prefilled(batch, [sequences[i] for i in texts], [rows[i] for i in texts],
                                     [stamps[i] for i in texts], [routes[i] for i in texts],
                                     [adapters[i] for i in texts])
        order = [rows[index] for index in expand]
        logits_all = torch.cat(logits)
        if order != list(range(batch.rows)):
            index = torch.tensor(order, dtype=torch.int64, device=self.device)
            batch.select(index)
            logits_all = logits_all.index_select(0, index)
        return batch, logits_all

    def _pieces(self, matches: list[PrefixMatch]) -> list[list[int]]:
        """Which sequences prefill in one forward: all of them, except that those the prefix cache holds part of run
        apart from the rest (a short continuation beside a long new prompt would recompute its history to match the
        prompt's width), and that batch-invariant decoding prefills each sequence alone (in a shared forward, a
        prompt's keys would sit beside another prompt's padding)."""
        if self.batch_invariant:
            return [[index] for index in range(len(matches))]
        misses = [index for index, match in enumerate(matches) if not match.length]
        hits = [index for index, match in enumerate(matches) if match.length]
        return [piece for piece in (misses, hits) if piece]

    def _start_piece(self, sequences: list[list[int]], matches: list[PrefixMatch], adapters: list[str | None],
                     visions: list[PromptVision | None]) -> _PieceRun:
        """Set up the prefill of `sequences`, each from the cached past its match offers, as far as that leaves every
        row with a past as many own tokens as the widest row (a row then never has padding inside it, which the
        static pool and batch-invariant attention need; one with a longer past recomputes some of it instead of
        padding, at no cost in the forwards' shape)."""
        width = max(len(sequence) - match.length for sequence, match in zip(sequences, matches, strict=True))
        used = [match.truncated(max(0, len(sequence) - width))
                for sequence, match in zip(sequences, matches, strict=True)]
        chunk = self.limits.prefill_chunk_tokens
        past_routes: list[torch.Tensor | None] = [None] * len(sequences)
        if any(taken.length for taken in used):
            assert self.prefix_cache is not None
            past = self.prefix_cache.gather([taken.slots for taken in used])
            if self.routers is not None:
                past_routes = [self.prefix_cache.routes_of(taken.slots) if taken.length else None for taken in used]
            own = [sequence[taken.length :] for sequence, taken in zip(sequences, used, strict=True)]
            prefill = ChunkedPrefill(self.model, own, self.pad_token_id, past=past, chunk_tokens=chunk)
        else:
            prefill = ChunkedPrefill(self.model, sequences, self.pad_token_id, chunk_tokens=chunk,
                                     share_prefix=self.share_prefix and not any(adapters), vision=visions)
        return _PieceRun(sequences, adapters, used, past_routes, prefill)

    def _advance(self, run: _PieceRun) -> int:
        """One forward of the piece's prefill, with its rows' adapters, keeping the routes it recorded; returns the
        tokens it computed."""
        with self._tapped() as taps, self._adapter_rows(run.adapters):
            forward = run.prefill.advance()
        if taps and not forward.shared:  # with routes recorded no prefix runs apart
            run.routes.append(_layers_last(taps).unflatten(0, (forward.rows, forward.columns)))
        return forward.tokens

    def _piece_routes(self, run: _PieceRun) -> list[torch.Tensor | None]:
        """Each row's routes of every token of its sequence (None where none are recorded): the cached past's, then
        those its forwards computed for its own tokens (the right end of the left-padded columns)."""
        if not run.routes:
            return [None] * len(run.sequences)
        table = torch.cat(run.routes, dim=1)  # [rows, width, layers, k]
        routes: list[torch.Tensor | None] = []
        for row, (sequence, taken) in enumerate(zip(run.sequences, run.used, strict=True)):
            computed = table[row, table.shape[1] - (len(sequence) - taken.length) :]
            past = run.past_routes[row]
            routes.append(computed if past is None else torch.cat([past, computed]))
        return routes

    def _append_sampled(self, samples: list[DecodingSequence], logits: torch.Tensor, version: int) -> torch.Tensor:
        """Sample each row's next token from its logits and append it; returns the tokens (a device tensor)."""
        params = RowParams.build(
            [sample.params.temperature for sample in samples],
            [sample.params.top_p for sample in samples],
            [sample.params.top_k for sample in samples],
            self.device,
        )
        uniforms = self._uniforms(samples, params)
        if self.held_back_tokens is not None:
            logits = logits.index_fill(-1, self.held_back_tokens, float("-inf"))
        logits = hold_back_stops(logits, samples)
        if self.batch_invariant:
            tokens, log_probs = sample_padded_rows(logits, params, uniforms)
        else:
            tokens, log_probs = sample_next_tokens(logits, params, uniforms)
        append_tokens(samples, tokens.tolist(), log_probs.tolist(),
                      [self.adapter_version(sample.adapter, version) for sample in samples])
        return tokens

    def _uniforms(self, samples: list[DecodingSequence], params: RowParams) -> torch.Tensor | None:
        """One uniform per row: from the sample's own generator when seeded, else from the engine's."""
        if not params.any_sampled:
            return None
        uniforms = torch.rand(len(samples), generator=self.rng)
        seeded = [
            (row, sample.generator)
            for row, sample in enumerate(samples)
            if sample.generator is not None and not sample.params.greedy
        ]
        if seeded:
            rows = torch.tensor([row for row, _ in seeded], dtype=torch.int64)
            draws = torch.cat([torch.rand(1, generator=generator) for _, generator in seeded])
            uniforms.index_copy_(0, rows, draws)
        return uniforms.to(self.device)

    def _check_stop(self, sample: DecodingSequence) -> bool:
        token = sample.output_ids[-1]
        if token in sample.stop_token_ids:
            sample.finish("stop", token)
        elif sample.params.stop and (matched := self._matched_stop_string(sample)) is not None:
            sample.finish("stop", matched)
        elif len(sample.output_ids) >= sample.max_new_tokens:
            sample.finish("length")
        return sample.finish_reason is not None

    def _matched_stop_string(self, sample: DecodingSequence) -> str | None:
        if self.tokenizer is None:
            raise RuntimeError("stop strings need a tokenizer; this engine was built without one")
        window = TOKENS_PER_CHARACTER_BOUND * max(len(stop) for stop in sample.params.stop) + 1
        tail = self.tokenizer.decode(sample.output_ids[-window:], skip_special_tokens=False)
        return next((stop for stop in sample.params.stop if stop in tail), None)

    def _evict(self, leaves: Callable[[DecodingSequence], bool]) -> list[DecodingSequence]:
        """Drop running rows for which `leaves(sample)` is true; returns them."""
        keep = [row for row, sample in enumerate(self.running) if not leaves(sample)]
        if len(keep) == len(self.running):
            return []
        left = [sample for sample in self.running if leaves(sample)]
        self._remember_leaving([(row, sample) for row, sample in enumerate(self.running) if leaves(sample)])
        order = self._keep_rows(keep)
        self.running = [self.running[row] for row in order]
        return left


def _layers_last(taps: list[RoutedLayer]) -> torch.Tensor:
    """One forward's taps, a [tokens, k] choice per layer, as int16 [tokens, layers, k] on the host."""
    return torch.stack([tap.chosen for tap in taps], dim=1).to("cpu", torch.int16)
