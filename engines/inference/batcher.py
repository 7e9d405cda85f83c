"""The synchronous heart of the torch engine: admit, prefill, decode, stop, evict, one step at a time.

`ContinuousBatcher` owns the waiting queue, the running rows and their `KVBatch`. One `step()` decodes one
token for every running row, admits waiting samples into the freed slots (prefilling them in a second
forward, which also samples their first token), then evicts the rows that finished. A short request
therefore leaves as soon as it is done and a waiting one takes its slot the very next step, instead of
the whole batch waiting for its longest member as `model.generate()` does.

It knows nothing about threads, futures or versions beyond the number it is told to stamp on the tokens of
a step: the engine (`torch_engine.py`) drives it from its decode thread and applies control commands
between steps.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from engines.inference.base import FinishReason, GenerateOutput, RoutedExperts, SamplingParams
from engines.inference.batch_invariant import sample_padded_rows
from engines.inference.kv_batch import KVBatch
from engines.inference.sampling import RowParams, sample_next_tokens
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
    `max_prefill_tokens` bounds the padded size of one prefill forward (its activations), except that one
    sample is always admitted when nothing runs.
    """

    max_batch_size: int = 64
    max_batch_tokens: int = 131_072
    max_prefill_tokens: int = 16_384

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchLimits.{name} must be an int >= 1, got {value!r}")


@dataclass(eq=False)
class DecodingSequence:
    """One sequence being generated: sample `sample_index` of request `request_id`.

    Invariant while running: the KV cache holds every token of `prompt_ids + output_ids` except the last
    output token, which is the next decode step's input.
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # the request's budget, clamped to the model's context
    stop_token_ids: frozenset[int]  # the request's stop ids plus the model's EOS ids unless ignore_eos
    generator: torch.Generator | None = None  # seeded requests only
    seed: int | None = None  # the sample's own seed (seeded requests; the static batcher draws one for the rest)
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    # With recorded routes: [tokens, layers, top_k] int16 chunks, one per prefill (which replaces them: it
    # recomputes every token so far) and one per decode step (the token fed in). See `base.RoutedExperts`.
    routes: list[torch.Tensor] = field(default_factory=list)
    # The oldest weight version among the keys and values its cache row holds (None: not in the cache). Set by
    # the prefill that computes them, not by whoever drops the cache, so a drop that did not happen shows.
    kv_version: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.sample_index)

    @property
    def worst_case_length(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    def finish(self, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        self.finish_reason = reason
        self.matched_stop = matched_stop

    def to_output(self) -> GenerateOutput:
        if self.finish_reason is None:
            raise RuntimeError(f"sample {self.key} is still running; it has no output yet")
        return GenerateOutput(
            request_id=self.request_id,
            output_ids=list(self.output_ids),
            log_probs=list(self.log_probs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            sample_index=self.sample_index,
            prompt_len=len(self.prompt_ids),
            matched_stop=self.matched_stop,
            routed_experts=routed_experts(self.routes),
        )


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


@dataclass(frozen=True)
class StepResult:
    finished: list[DecodingSequence]
    new_tokens: int
    record: StepRecord


class ContinuousBatcher:
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
    ) -> None:
        """`batch_invariant`: the model was made batch-invariant (`batch_invariant.make_batch_invariant`); then each
        distinct sequence is prefilled on its own and sampling sees padded rows, so a row's tokens and log-probs
        do not depend on the rows beside it either. `record_routes`: an MoE model's samples carry the experts each
        of their tokens was routed to (rollout routing replay)."""
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
        self.kv = KVBatch.empty(self.device)
        self.steps = 0
        # Tokens sampled from a cache row whose oldest keys/values an older weight version computed: zero when
        # the engine drops the cache at every update (`drop_cache`), the count of off-policy tokens otherwise.
        self.stale_kv_tokens = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, samples: list[DecodingSequence]) -> None:
        self.waiting.extend(samples)

    def step(self, version: int) -> StepResult:
        decoded = list(self.running)
        self.stale_kv_tokens += sum(1 for sample in decoded if sample.kv_version != version)
        if decoded:
            self._decode(decoded, version)
        admitted = self._admit()
        if admitted:
            self._join(admitted, version)
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
        )
        return StepResult(finished=finished, new_tokens=len(decoded) + len(admitted), record=record)

    def abort(self, request_ids: set[str] | None) -> list[DecodingSequence]:
        """Remove the samples of `request_ids` (all with None), mark them aborted and return them."""

        def doomed(sample: DecodingSequence) -> bool:
            return request_ids is None or sample.request_id in request_ids

        aborted = [sample for sample in self.waiting if doomed(sample)]
        self.waiting = deque(sample for sample in self.waiting if not doomed(sample))
        aborted += self._evict(doomed)
        for sample in aborted:
            sample.finish("abort")
        return aborted

    def reset(self) -> list[DecodingSequence]:
        """Abandon everything (after a failed step, when the cache may be half-updated); returns the samples."""
        dropped = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        self._clear_cache()
        for sample in dropped:
            sample.finish("abort")
        return dropped

    def drop_cache(self) -> None:
        """Forget the KV cache (it was computed by old weights); running samples are re-prefilled first.

        They go back to the front of the queue with their outputs so far, so the next step recomputes their
        cache with the current weights and samples their next token from it. They were admitted already,
        so they fit the budget again.
        """
        for sample in self.running:
            sample.kv_version = None
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        self._clear_cache()

    # ----- the cache: what a batcher with another KV layout replaces (static_batcher.py) -----

    @property
    def cache_columns(self) -> int:
        return self.kv.columns

    def _clear_cache(self) -> None:
        self.kv = KVBatch.empty(self.device)

    def _decode(self, decoded: list[DecodingSequence], version: int) -> None:
        last_tokens = torch.tensor([sample.output_ids[-1] for sample in decoded], device=self.device)
        with self._tapped() as taps:
            logits = self.kv.decode(self.model, last_tokens)
        if taps:
            for sample, route in zip(decoded, _layers_last(taps).unsqueeze(1), strict=True):
                sample.routes.append(route)
        self._append_sampled(decoded, logits, version)

    def _tapped(self) -> contextlib.AbstractContextManager[list[RoutedLayer]]:
        return self.routers.tapped() if self.routers is not None else contextlib.nullcontext([])

    def _join(self, admitted: list[DecodingSequence], version: int) -> None:
        batch, logits = self._prefill(admitted)
        for sample in admitted:
            sample.kv_version = version
        self._append_sampled(admitted, logits, version)
        self.kv.extend(batch)

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
            width = max(prefill_width, len(candidate.prompt_ids) + len(candidate.output_ids))
            nothing_else = rows == 1
            if not nothing_else and not self._fits(rows, columns):
                break
            if admitted and (len(admitted) + 1) * width > limits.max_prefill_tokens:
                break
            admitted.append(self.waiting.popleft())
            worst_columns, prefill_width = columns, width
        return admitted

    def _prefill(self, admitted: list[DecodingSequence]) -> tuple[KVBatch, torch.Tensor]:
        """Prefill each distinct token sequence once (n samples of a prompt share it), then fan rows out; returns
        the rows' cache and their next-token logits."""
        unique: dict[tuple[int, ...], int] = {}
        sequences: list[list[int]] = []
        expand: list[int] = []
        for sample in admitted:
            tokens = sample.prompt_ids + sample.output_ids
            key = tuple(tokens)
            if key not in unique:
                unique[key] = len(sequences)
                sequences.append(tokens)
            expand.append(unique[key])
        with self._tapped() as taps:
            batch, logits = self._prefill_forward(sequences)
        if taps:
            routes = self._prefill_routes(taps, sequences)
            for sample, index in zip(admitted, expand, strict=True):
                sample.routes = [routes[index]]
        if len(sequences) != len(admitted):
            rows = torch.tensor(expand, dtype=torch.int64, device=self.device)
            batch.select(rows)
            logits = logits.index_select(0, rows)
        return batch, logits

    def _prefill_routes(self, taps: list[RoutedLayer], sequences: list[list[int]]) -> list[torch.Tensor]:
        """Each sequence's routes [len, layers, k] from the prefill's taps: one forward of left-padded rows, or one
        forward per sequence (batch-invariant)."""
        assert self.routers is not None
        layers = len(self.routers.modules)
        if self.batch_invariant:
            return [_layers_last(taps[index * layers : (index + 1) * layers]) for index in range(len(sequences))]
        width = max(len(sequence) for sequence in sequences)
        rows = _layers_last(taps).unflatten(0, (len(sequences), width))
        return [row[width - len(sequence) :] for row, sequence in zip(rows, sequences, strict=True)]

    def _prefill_forward(self, sequences: list[list[int]]) -> tuple[KVBatch, torch.Tensor]:
        if not self.batch_invariant:
            return KVBatch.prefill(self.model, sequences, self.pad_token_id, share_prefix=self.share_prefix)
        # One forward per sequence: in a shared one, a prompt's keys would sit beside another prompt's padding.
        batch, logits = KVBatch.empty(self.device), []
        for sequence in sequences:
            alone, last_logits = KVBatch.prefill(self.model, [sequence], self.pad_token_id)
            batch.extend(alone)
            logits.append(last_logits)
        return batch, torch.cat(logits)

    def _append_sampled(self, samples: list[DecodingSequence], logits: torch.Tensor, version: int) -> torch.Tensor:
        """Sample each row's next token from its logits and append it; returns the tokens (a device tensor)."""
        params = RowParams.build(
            [sample.params.temperature for sample in samples],
            [sample.params.top_p for sample in samples],
            [sample.params.top_k for sample in samples],
            self.device,
        )
        uniforms = self._uniforms(samples, params)
        if self.batch_invariant:
            tokens, log_probs = sample_padded_rows(logits, params, uniforms)
        else:
            tokens, log_probs = sample_next_tokens(logits, params, uniforms)
        append_tokens(samples, tokens.tolist(), log_probs.tolist(), version)
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
        order = self._keep_rows(keep)
        self.running = [self.running[row] for row in order]
        return left


def append_tokens(samples: list[DecodingSequence], tokens: list[int], log_probs: list[float], version: int) -> None:
    """Each sample's newest token, its log-prob and the weight version that sampled it (host lists)."""
    for sample, token, log_prob in zip(samples, tokens, log_probs, strict=True):
        sample.output_ids.append(token)
        sample.log_probs.append(log_prob)
        sample.versions.append(version)


def _layers_last(taps: list[RoutedLayer]) -> torch.Tensor:
    """One forward's taps, a [tokens, k] choice per layer, as int16 [tokens, layers, k] on the host."""
    return torch.stack([tap.chosen for tap in taps], dim=1).to("cpu", torch.int16)


def routed_experts(routes: list[torch.Tensor]) -> RoutedExperts | None:
    if not routes:
        return None
    return RoutedExperts.of(torch.cat(routes).numpy())
