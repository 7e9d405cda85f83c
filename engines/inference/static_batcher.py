"""Continuous batching on a KV pool allocated once, with each decode step replayed from a CUDA graph on a GPU.

The dynamic batcher (`batcher.py`) is the CPU reference: its cache fits the rows exactly, which is what a CPU wants,
since there compute scales with the cache. On a GPU a decode step at a few hundred rows costs a few milliseconds of
device work behind hundreds of kernel launches and several host syncs, so the same step is launch-bound (the
11-27 H100 record: 243 tokens/s against `generate()`'s 238). Here

* the cache is a `KVPool` (`static_kv.py`): rows enter and leave by copies into and out of their slot;
* a decode step (embed, layers, norm, head, sampling) reads and writes only fixed buffers, so on CUDA it is
  captured once per (row bucket, column bucket, sampling mode) and replayed: one launch instead of hundreds;
* sampling draws from `counter_uniforms(seed, position)` on the device: no generator per row and no host RNG,
  and a sample's tokens still depend only on its own seed, whatever rows share the step;
* the host reads one small copy per step (the new tokens and their log-probs), for stop checks.

Admission, prefill (the dynamic path, shared prompt prefixes included), stop checks and the step records are the
dynamic batcher's: only where the keys and values live differs.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from engines.inference.batcher import BatchLimits, ContinuousBatcher
from engines.inference.decoding_sequence import DecodingSequence, append_tokens
from engines.inference.kv_batch import KVBatch, _cache_argument
from engines.inference.prefix_cache import PrefixCache
from engines.inference.sampling import RowParams, counter_uniforms, sample_next_tokens
from engines.inference.static_kv import KVPool, PooledCache

GREEDY, SAMPLED, TRUNCATED = "greedy", "sampled", "truncated"


def bucket(value: int, granule: int, limit: int) -> int:
    """`value` rounded up to a multiple of `granule` (a power of two up to `granule`), at most `limit`."""
    rounded = 1 << max(0, value - 1).bit_length()
    if rounded > granule:
        rounded = -(-value // granule) * granule
    return min(max(rounded, 1), limit)


class DecodeStep:
    """One decode step over the pool's first rows, on fixed input and output buffers; replayed from CUDA graphs."""

    def __init__(self, model: nn.Module, pool: KVPool, use_graphs: bool) -> None:
        self.model, self.pool = model, pool
        slots, device = pool.slots, pool.device
        self.input_ids = torch.zeros(slots, dtype=torch.int64, device=device)
        self.positions = torch.zeros(slots, dtype=torch.int64, device=device)  # of each row's input token
        self.seeds = torch.zeros(slots, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(slots, dtype=torch.int64, device=device)
        self.log_probs = torch.zeros(slots, dtype=torch.float32, device=device)
        self.cache = PooledCache(pool)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self._graph_memory = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def run(self, live: int, rows: int, columns: int, mode: str) -> None:
        """Decode one token for slots [0, rows) attending to columns [0, columns); then advance the inputs of the
        `live` first rows (the rest pad the step to its bucket, and keep their positions in the model's range)."""
        if self.use_graphs:
            self._graph(rows, columns, mode).replay()
        else:
            self._body(rows, columns, mode)
        self.input_ids[:live].copy_(self.tokens[:live])
        self.positions[:live] += 1
        self.pool.column += 1

    def forget_graphs(self) -> None:
        """Captured graphs name the pool's addresses; after the pool is released they must not be replayed."""
        self.graphs.clear()

    def _body(self, rows: int, columns: int, mode: str) -> None:
        pool = self.pool
        pool.set_view(rows, columns)
        pool.allowed[:rows].index_fill_(1, pool.column, True)
        mask = pool.allowed[:rows, :columns].view(rows, 1, 1, columns)
        logits = self.model(
            input_ids=self.input_ids[:rows].unsqueeze(-1),
            attention_mask=mask,
            position_ids=self.positions[:rows].unsqueeze(-1),
            use_cache=True,
            **{_cache_argument(self.model): self.cache},
        ).logits[:, -1]
        params = RowParams(self.temperature[:rows], self.top_p[:rows], self.top_k[:rows],
                           any_sampled=mode != GREEDY, any_greedy=True, any_truncated=mode == TRUNCATED)
        uniforms = None if mode == GREEDY else counter_uniforms(self.seeds[:rows], self.positions[:rows] + 1)
        tokens, log_probs = sample_next_tokens(logits, params, uniforms)
        self.tokens[:rows].copy_(tokens)
        self.log_probs[:rows].copy_(log_probs)

    def _graph(self, rows: int, columns: int, mode: str) -> torch.cuda.CUDAGraph:
        key = (rows, columns, mode)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        started = time.perf_counter()
        # A warm-up outside capture (lazy initialisations, cuBLAS handles) on a side stream, as capture requires.
        # It writes what the replay rewrites: this step's column of keys, values and mask, and the outputs.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(rows, columns, mode)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_memory):
            self._body(rows, columns, mode)
        self.graphs[key] = graph
        self.capture_seconds += time.perf_counter() - started
        return graph


class StaticBatcher(ContinuousBatcher):
    """`ContinuousBatcher` on a `KVPool` of `limits.max_batch_size` slots x `columns` columns."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, limits: BatchLimits,
                 rng: torch.Generator, *, columns: int, use_graphs: bool = True, row_granule: int = 32,
                 column_granule: int = 256, prefix_cache: PrefixCache | None = None) -> None:
        """`columns` is the longest row (prompt + answer) the pool holds; the pool is allocated on first use.
        Steps run over row counts and column counts rounded up to `row_granule` / `column_granule` (powers of two
        below them), so a few graphs cover every step; 1 and 1 run each step at its exact size (no graphs)."""
        super().__init__(model, tokenizer, limits, rng, prefix_cache=prefix_cache)
        # Rows are contiguous in their slot (padding, then tokens), so a row's first column is known on the host and
        # compaction can always make room; a prefix shared in prefill would leave padding inside rows.
        self.share_prefix = False
        self.pool = KVPool(model, limits.max_batch_size, columns)
        self.decoder = DecodeStep(model, self.pool, use_graphs)
        self.row_granule, self.column_granule = row_granule, column_granule
        self.write_column = 0  # the host's copy of pool.column, so no step reads it back
        self.start_columns: list[int] = []  # per running row (= slot): the first column it attends to
        self.shifts = {"left": 0, "right": 0}  # compactions, and moves for a joining row longer than the column

    @property
    def cache_columns(self) -> int:
        return self.write_column - min(self.start_columns, default=self.write_column)

    def admissible(self, sample: DecodingSequence) -> str | None:
        """Why `sample` can never run here (None if it can): a row longer than the pool's columns, or a minimum
        length (the decode step's graph samples every row alike)."""
        if sample.params.min_new_tokens:
            return "min_new_tokens needs kv_cache='dynamic' (the static pool's decode step holds back no tokens)"
        if sample.worst_case_length > self.pool.columns:
            return (f"prompt ({len(sample.prompt_ids)}) + max_new_tokens ({sample.max_new_tokens}) exceeds the static "
                    f"KV pool's {self.pool.columns} columns per row")
        return None

    def release_memory(self) -> None:
        """Free the pool and the graphs that name it (nothing may be running)."""
        if self.running:
            raise RuntimeError("StaticBatcher.release_memory: rows are running")
        self.decoder.forget_graphs()
        self.pool.release()

    def _fits(self, rows: int, columns: int) -> bool:
        return rows <= self.pool.slots

    def _clear_cache(self) -> None:
        super()._clear_cache()
        self.write_column = 0
        self.start_columns = []

    def _decode(self, decoded: list[DecodingSequence], version: int) -> None:
        rows = len(decoded)
        if self.write_column == self.pool.columns:
            if min(self.start_columns) == 0:  # admissible() keeps every row below the pool's width
                raise RuntimeError(f"static KV pool full: a running row spans all {self.pool.columns} columns")
            self._shift(-min(self.start_columns))
        step_rows = bucket(rows, self.row_granule, self.pool.slots)
        step_columns = bucket(self.write_column + 1, self.column_granule, self.pool.columns)
        self.decoder.run(rows, step_rows, step_columns, self._mode(decoded))
        self.write_column += 1
        tokens = self.decoder.tokens[:rows].tolist()
        log_probs = self.decoder.log_probs[:rows].tolist()
        append_tokens(decoded, tokens, log_probs, [version] * rows)

    def _mode(self, samples: list[DecodingSequence]) -> str:
        if all(sample.params.greedy for sample in samples):
            return GREEDY
        if any(not sample.params.greedy and (sample.params.top_p < 1 or sample.params.top_k > 0)
               for sample in samples):
            return TRUNCATED
        return SAMPLED

    def _join(self, admitted: list[DecodingSequence], batch: KVBatch, logits: torch.Tensor, version: int) -> None:
        if not self.pool.allocated:
            self.pool.allocate()
            self.decoder.forget_graphs()
        self.stale_kv_tokens += sum(1 for sample in admitted if sample.kv_version != version)
        width = batch.columns
        if not self.running:  # an empty pool starts over at the left
            self._set_write_column(width)
        elif width > self.write_column:
            self._shift(width - self.write_column)
        first = len(self.running)
        slots = list(range(first, first + len(admitted)))
        self.pool.place(slots, batch, self.write_column)
        self.start_columns += [self.write_column - len(s.prompt_ids) - len(s.output_ids) for s in admitted]
        for sample in admitted:
            if sample.seed is None:
                sample.seed = int(torch.randint(0, 1 << 62, (1,), generator=self.rng))
        tokens = self._append_sampled(admitted, logits, version)
        decoder, index = self.decoder, torch.tensor(slots, dtype=torch.int64, device=self.device)
        decoder.input_ids.index_copy_(0, index, tokens)
        decoder.positions.index_copy_(0, index, batch.next_positions)
        per_row = [
            (decoder.seeds, [sample.seed for sample in admitted]),
            (decoder.temperature, [sample.params.temperature for sample in admitted]),
            (decoder.top_p, [sample.params.top_p for sample in admitted]),
            (decoder.top_k, [sample.params.top_k for sample in admitted]),
        ]
        for buffer, values in per_row:
            buffer.index_copy_(0, index, torch.tensor(values, dtype=buffer.dtype, device=self.device))

    def _row_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.pool.keys, self.pool.values

    def _row_columns(self, rows: list[int], counts: list[int]) -> list[torch.Tensor]:
        """A row's tokens fill its slot from its first column to the write column (known here, so nothing is read
        back from the device)."""
        spans = [(self.start_columns[row], self.write_column) for row in rows]
        if [end - start for start, end in spans] != counts:
            raise RuntimeError(f"static KV pool rows hold {[end - start for start, end in spans]} tokens, their "
                               f"sequences {counts}")
        return [torch.arange(start, end, device=self.device) for start, end in spans]

    def _uniforms(self, samples: list[DecodingSequence], params: RowParams) -> torch.Tensor | None:
        """The same draws decode steps make: from (seed, position of the token drawn)."""
        if not params.any_sampled:
            return None
        seeds = torch.tensor([sample.seed for sample in samples], dtype=torch.int64, device=self.device)
        positions = [len(sample.prompt_ids) + len(sample.output_ids) for sample in samples]
        return counter_uniforms(seeds, torch.tensor(positions, dtype=torch.int64, device=self.device))

    def _keep_rows(self, keep: list[int]) -> list[int]:
        """Fill the holes below the new row count with the highest rows that stay: the running order follows the
        slots, so it changes."""
        count = len(keep)
        kept = set(keep)
        holes = [slot for slot in range(count) if slot not in kept]
        movers = [slot for slot in keep if slot >= count]
        order = list(range(len(self.running)))
        if holes:
            self.pool.move(movers, holes)
            decoder = self.decoder
            source = torch.tensor(movers, dtype=torch.int64, device=self.device)
            target = torch.tensor(holes, dtype=torch.int64, device=self.device)
            for buffer in (decoder.input_ids, decoder.positions, decoder.seeds, decoder.temperature, decoder.top_p,
                           decoder.top_k):
                buffer.index_copy_(0, target, buffer.index_select(0, source))
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
                self.start_columns[hole] = self.start_columns[mover]
        gone = list(range(count, len(self.running)))
        if gone:
            self.pool.clear(gone)
        del self.start_columns[count:]
        return order[:count]

    def _shift(self, offset: int) -> None:
        """Move every running row `offset` columns (left when negative), with the shared write column."""
        first = min(self.start_columns)
        self.shifts["left" if offset < 0 else "right"] += 1
        self.pool.shift(len(self.running), first, self.write_column, offset)
        self.start_columns = [start + offset for start in self.start_columns]
        self._set_write_column(self.write_column + offset)

    def _set_write_column(self, column: int) -> None:
        self.write_column = column
        self.pool.column.fill_(column)
