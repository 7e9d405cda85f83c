"""A KV cache allocated once: one pool per layer that rows enter and leave without the cache ever being re-stacked.

The dynamic layout (`kv_batch.py`) concatenates, index-selects and re-stacks whole caches as rows come and go, and
each of those shapes is new to the device: fine on a CPU, fatal to CUDA graphs and launch-bound on a GPU. Here each
layer owns `[slots, kv_heads, columns, head_dim]` keys and values for the engine's whole life, and every live row
writes its newest token at one shared column (`column`, a device scalar), so one decode step has the same shape and
the same addresses step after step, and can be captured once and replayed.

* A row that joins is prefilled by the dynamic path and copied into a free slot, right-aligned so that its last
  token sits just left of the shared column; a boolean mask row says which of its columns hold real tokens.
* A row that leaves frees its slot; the highest live slot moves into the hole, so live rows stay in slots
  `[0, rows)` and a step runs over a prefix of the pool.
* When the shared column reaches the end, every live row moves left by the padding all of them share (rare:
  once per `columns - longest row` steps); a joining row longer than the shared column moves them right.

HF models run unchanged on it: `PooledCache` is a `transformers.Cache` whose layers write the new token's keys
and values at the shared column and hand attention the pool's first `columns` columns; the caller passes the
4-D mask, which transformers takes as it is.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from engines.inference.kv_batch import KVBatch


class KVPool:
    """Keys, values and the attended-columns mask of `slots` rows of up to `columns` tokens, for every layer."""

    def __init__(self, model: nn.Module, slots: int, columns: int) -> None:
        config = model.config
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.slots, self.columns = slots, columns
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.allowed = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.column = torch.zeros(1, dtype=torch.int64, device=self.device)  # where the next decode step writes
        # The step's view: its first `view_rows` slots and `view_columns` columns (set by the caller per step).
        self.view_rows, self.view_columns = 0, 0

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.slots * self.kv_heads * self.columns * self.head_dim * self.dtype.itemsize

    def allocate(self) -> None:
        shape = (self.slots, self.kv_heads, self.columns, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.allowed = torch.zeros(self.slots, self.columns, dtype=torch.bool, device=self.device)

    def release(self) -> None:
        """Give the pool's memory back (a colocated engine between turns); `allocate` makes a new one."""
        self.keys, self.values = [], []
        self.allowed = torch.zeros(0, 0, dtype=torch.bool, device=self.device)

    def set_view(self, rows: int, columns: int) -> None:
        self.view_rows, self.view_columns = rows, columns

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One decode token per row ([rows, kv_heads, 1, head_dim]) into the shared column; returns the view."""
        if key_states.shape[-2] != 1:
            raise RuntimeError(f"KVPool.write: {key_states.shape[-2]} tokens per row; the pool decodes one at a time "
                               "(prefill runs on the dynamic cache and is copied in with place)")
        rows, columns = self.view_rows, self.view_columns
        keys, values = self.keys[layer][:rows], self.values[layer][:rows]
        keys.index_copy_(2, self.column, key_states)
        values.index_copy_(2, self.column, value_states)
        return keys[:, :, :columns], values[:, :, :columns]

    def place(self, slots: list[int], batch: KVBatch, end: int) -> None:
        """Copy `batch`'s rows (in order) into `slots`, right-aligned to end just before column `end`."""
        width = batch.columns
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for layer, cached in enumerate(batch.cache.layers):
            self.keys[layer][:, :, end - width : end].index_copy_(0, index, cached.keys.to(self.dtype))
            self.values[layer][:, :, end - width : end].index_copy_(0, index, cached.values.to(self.dtype))
        self.allowed.index_fill_(0, index, False)
        self.allowed[:, end - width : end].index_copy_(0, index, batch.attention_mask.bool())

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Copy the rows of slots `sources` into slots `targets` (disjoint)."""
        source = torch.tensor(sources, dtype=torch.int64, device=self.device)
        target = torch.tensor(targets, dtype=torch.int64, device=self.device)
        for tensors in (self.keys, self.values, [self.allowed]):
            for tensor in tensors:
                tensor.index_copy_(0, target, tensor.index_select(0, source))

    def clear(self, slots: list[int]) -> None:
        self.allowed.index_fill_(0, torch.tensor(slots, dtype=torch.int64, device=self.device), False)

    def shift(self, rows: int, first: int, end: int, offset: int) -> None:
        """Move columns `[first, end)` of the first `rows` slots by `offset` (either sign); vacated columns are
        masked off."""
        width = end - first
        for tensors in (self.keys, self.values, [self.allowed]):
            for tensor in tensors:
                region = tensor[:rows].narrow(-2 if tensor.dim() == 4 else -1, first, width).clone()
                tensor[:rows].narrow(-2 if tensor.dim() == 4 else -1, first + offset, width).copy_(region)
        vacated = range(first, first + offset) if offset > 0 else range(end + offset, end)
        self.allowed[:rows, vacated.start : vacated.stop] = False


class _PoolLayer(CacheLayerMixin):
    """One layer of `PooledCache`: what transformers' attention calls `update` on."""

    is_compileable = True

    def __init__(self, pool: KVPool, layer: int) -> None:
        super().__init__()
        self._pool, self._layer = pool, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._pool.write(self._layer, key_states, value_states)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._pool.view_columns, 0

    def get_seq_length(self) -> int:
        raise RuntimeError("PooledCache has no sequence length: pass position_ids and a 4-D attention mask")

    def get_max_length(self) -> int:
        return self._pool.columns

    def get_max_cache_shape(self) -> int:
        return self._pool.columns


class PooledCache(Cache):
    """The pool as a `transformers.Cache`, for decode steps only (one new token per row)."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(layers=[_PoolLayer(pool, layer) for layer in range(pool.layers)])
