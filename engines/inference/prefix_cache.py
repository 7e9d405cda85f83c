"""The torch engine's prefix cache: keys and values computed for one request, reused by any later request that starts
with the same tokens (the next turn of a conversation, another sample of a group's prompt, a common system prompt).

Structure: a radix tree over token ids, as SGLang's RadixAttention keeps one. A node is a run of tokens with the pool
slots that hold their keys and values; its children are keyed by their first token. A request walks down from the
root and takes the longest run it finds; only the rest is prefilled. A token-level tree rather than vLLM's hashes of
fixed-size blocks: a conversation grows by a few tens of tokens a turn and a group's prompt ends anywhere, so a block
hash would recompute up to a block per turn and per prompt; and since the keys and values sit in a pool of token slots
that one gather reads whatever the runs, cutting a node in two (a new branch) moves no tensor.

Memory: one pool of `capacity` token slots, `[layers, slots, kv_heads, head_dim]` keys and the same for values, sized
from a byte budget and allocated at the first insert. Slot 0 stays zero: it is what padding columns gather. When the
pool is full, least recently used leaves go first (those of other weights before any usable one). A running row
holds its own copy of what it took (the gather copies), so no slot is ever referenced by a row and any leaf may go,
except those of the insert in progress.

Weights: every node carries the weights epoch it was computed under (the engine counts every weight load, so a repush
under the same version number is another epoch) and the oldest policy version its keys and values depend on. With
`same_weights_only` (the engine's `recompute_kv_on_update`) a node is reused only at the epoch the engine serves
(`usable`): KV of older weights is never attended by a newer sample, without anything having to flush the tree at an
update. Nodes of older epochs stay until evicted (first) or rewritten by the next request that computes them again,
and what a request would have reused from them is counted (`stale_tokens`): what a session that spans an update
prefilled again. Without it (SGLang's keep) old nodes are reused, and the batcher's account counts the tokens sampled
over them, as over any older KV.

Adapters: rows served with a LoRA adapter (`multi_lora.py`) compute other keys and values from the same tokens, so
each adapter has a tree of its own (`namespace`, None for the base weights), and its epoch is the newest load of the
base weights or of that adapter: loading one policy's adapter voids its own entries only. The pool and the eviction
order are shared: a busy adapter may take the slots of an idle one's leaves.

Thread safety: the decode thread inserts and matches; `holds` (a router asking how much of a prefix this engine has)
may come from another thread, so the tree is changed and read under a lock.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

# When the pool is full, an insert frees at least this share of it at once, so eviction (a walk over the leaves) runs
# once per many inserts rather than at every one.
EVICTION_CHUNK = 1 / 16


@dataclass(eq=False, slots=True)
class _Node:
    tokens: list[int]
    slots: np.ndarray  # int64, the pool slot of each token's keys and values
    parent: _Node | None
    epoch: int  # the weights its keys and values were computed under
    version: int  # the oldest policy version they depend on
    last_used: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixMatch:
    """What the cache holds of a token sequence, from its start: `length` tokens in `slots`, usable at the weights
    asked about. `spans` are (end, version, epoch) of the nodes the run crosses, so a shorter use of it still knows
    the oldest weights it depends on. `stale` counts the further tokens it holds from other weights."""

    length: int = 0
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    spans: tuple[tuple[int, int, int], ...] = ()
    stale: int = 0

    def truncated(self, length: int) -> PrefixMatch:
        """The first `length` tokens of the match (at most its own length)."""
        length = min(length, self.length)
        spans = tuple(span for index, span in enumerate(self.spans)
                      if index == 0 or self.spans[index - 1][0] < length) if length else ()
        return PrefixMatch(length, self.slots[:length], spans, self.stale)

    @property
    def version(self) -> int | None:
        """The oldest policy version the run's keys and values depend on (None: empty)."""
        return min((version for _, version, _ in self.spans), default=None)

    @property
    def epoch(self) -> int | None:
        return min((epoch for _, _, epoch in self.spans), default=None)


@dataclass(frozen=True)
class CachedPast:
    """Each row's leading keys and values, gathered from the pool right-aligned in `columns` columns (zeros to their
    left): per layer [rows, kv_heads, columns, head_dim]. Row i holds `lengths[i]` real columns."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: list[int]

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


@dataclass(frozen=True)
class Insert:
    """A sequence whose keys and values sit in row `row` of a cache, token i at column `columns[i]`; `routes` are its
    tokens' routed experts ([tokens, layers, top_k] int16) where the engine records them."""

    tokens: list[int]
    row: int
    columns: torch.Tensor
    version: int
    epoch: int
    routes: torch.Tensor | None = None


@dataclass
class PrefixCacheCounters:
    lookups: int = 0  # distinct sequences prefilled
    hits: int = 0  # of which some tokens came from the cache
    reused_tokens: int = 0  # tokens whose keys and values came from the cache
    prefilled_tokens: int = 0  # tokens a prefill forward computed
    stale_tokens: int = 0  # tokens the cache held from older weights, prefilled again
    inserted_tokens: int = 0
    evicted_tokens: int = 0

    def prefilled(self, tokens: int, reused: int, stale: int) -> None:
        """One distinct sequence prefilled: `tokens` long, `reused` of them from the cache, `stale` held from older
        weights."""
        self.lookups += 1
        self.hits += reused > 0
        self.reused_tokens += reused
        self.prefilled_tokens += tokens - reused
        self.stale_tokens += stale


class PrefixCache:
    """Keys and values by token prefix, within a byte budget; see the module docstring."""

    def __init__(self, budget_bytes: int, *, same_weights_only: bool = True) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ValueError(f"prefix cache budget must be an int >= 1 byte, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.same_weights_only = same_weights_only
        self.counters = PrefixCacheCounters()
        self._lock = threading.Lock()
        self._ticks = itertools.count(1)
        # One tree per namespace (None: the base weights; else an adapter's name). A root's epoch is the newest its
        # namespace was asked about, which is the one it serves: eviction takes the other epochs' leaves first.
        self._roots: dict[str | None, _Node] = {}
        self.keys: torch.Tensor | None = None  # [layers, capacity + 1, kv_heads, head_dim], allocated on first insert
        self.values: torch.Tensor | None = None
        self.routes: torch.Tensor | None = None  # [capacity + 1, layers, top_k] int16 on the host, when recorded
        self.capacity = 0
        self._free = np.zeros(0, dtype=np.int64)  # a stack of free slots, the first `_free_count` valid
        self._free_count = 0

    # ----- reading -----

    def usable(self, node: _Node, epoch: int) -> bool:
        """Whether `node`'s keys and values may be attended by a request served at weights `epoch`."""
        return not self.same_weights_only or node.epoch == epoch

    def match(self, tokens: list[int], epoch: int, *, namespace: str | None = None, limit: int | None = None,
              touch: bool = True) -> PrefixMatch:
        """The longest run of `tokens[:limit]` the cache holds in `namespace` usable at `epoch`; `touch` marks it
        recently used."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        with self._lock:
            node, walked, length, stale = self._root(namespace, epoch), 0, 0, 0
            runs: list[np.ndarray] = []
            spans: list[tuple[int, int, int]] = []
            path: list[_Node] = []
            while walked < limit:
                child = node.children.get(tokens[walked])
                if child is None:
                    break
                common = _common_length(child.tokens, tokens, walked, limit)
                if length == walked and self.usable(child, epoch):
                    runs.append(child.slots[:common])
                    length += common
                    spans.append((length, child.version, child.epoch))
                    path.append(child)
                else:
                    stale += common
                walked += common
                if common < len(child.tokens):
                    break
                node = child
            if touch and path:
                tick = next(self._ticks)
                for visited in path:
                    visited.last_used = tick
        slots = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
        return PrefixMatch(length, slots, tuple(spans), stale)

    def holds(self, tokens: list[int], epoch: int, namespace: str | None = None) -> int:
        """How many leading tokens of `tokens` this cache holds in `namespace` usable at `epoch` (what a router asks
        an engine)."""
        return self.match(tokens, epoch, namespace=namespace, touch=False).length

    def gather(self, slot_rows: list[np.ndarray]) -> CachedPast:
        """The keys and values of each row's slots, right-aligned: the past a prefill of the rest attends to."""
        if self.keys is None or self.values is None:
            raise RuntimeError("prefix cache: gather before anything was inserted")
        columns = max(len(slots) for slots in slot_rows)
        index = np.zeros((len(slot_rows), columns), dtype=np.int64)  # slot 0: zeros, for the padding columns
        for row, slots in enumerate(slot_rows):
            index[row, columns - len(slots):] = slots
        flat = torch.from_numpy(index.reshape(-1)).to(self.keys.device)
        layers, _, heads, head_dim = self.keys.shape
        shape = (layers, len(slot_rows), columns, heads, head_dim)
        keys = self.keys.index_select(1, flat).view(shape).transpose(2, 3)
        values = self.values.index_select(1, flat).view(shape).transpose(2, 3)
        return CachedPast(list(keys.unbind(0)), list(values.unbind(0)), [len(slots) for slots in slot_rows])

    def routes_of(self, slots: np.ndarray) -> torch.Tensor:
        """The routed experts recorded with `slots` ([tokens, layers, top_k] int16)."""
        if self.routes is None:
            raise RuntimeError("prefix cache: no routed experts were inserted with these keys and values")
        return self.routes.index_select(0, torch.from_numpy(slots))

    @property
    def held_tokens(self) -> int:
        return self.capacity - self._free_count

    # ----- writing -----

    def insert(self, entries: list[Insert], keys: list[torch.Tensor], values: list[torch.Tensor], epoch: int,
               namespace: str | None = None) -> None:
        """Add what `entries` hold beyond what `namespace` has usable at `epoch`, copying their keys and values out of
        `keys`/`values` (per layer [rows, kv_heads, columns, head_dim]). A run the cache holds from other weights is
        rewritten in place; a full pool evicts first, and what does not fit is left out."""
        if not entries:
            return
        if self.keys is None:
            self._allocate_pool(keys)
            if self.keys is None:  # the budget holds no token of this model
                return
        rows: list[int] = []
        columns: list[torch.Tensor] = []
        slots: list[np.ndarray] = []
        routes: list[tuple[np.ndarray, torch.Tensor]] = []
        with self._lock:
            tick = next(self._ticks)  # this insert's nodes carry it, and no eviction of this insert takes them
            for entry in entries:
                for start, run in self._place(entry, namespace, epoch, tick):
                    rows.append(entry.row)
                    columns.append(entry.columns[start : start + len(run)])
                    slots.append(run)
                    if entry.routes is not None:
                        routes.append((run, entry.routes[start : start + len(run)]))
        if not slots:
            return
        self._write(rows, columns, slots, keys, values)
        for run, table in routes:
            self._write_routes(run, table)

    def clear(self) -> None:
        """Forget everything and give the pool's memory back; the next insert allocates it again."""
        with self._lock:
            self.counters.evicted_tokens += self.held_tokens
            self._roots.clear()
            self.keys = self.values = self.routes = None
            self.capacity = self._free_count = 0
            self._free = np.zeros(0, dtype=np.int64)

    def _allocate_pool(self, keys: list[torch.Tensor]) -> None:
        sample = keys[0]
        _, heads, _, head_dim = sample.shape
        per_token = 2 * len(keys) * heads * head_dim * sample.element_size()
        capacity = self.budget_bytes // per_token
        if capacity < 1:
            return
        shape = (len(keys), capacity + 1, heads, head_dim)
        self.keys = torch.empty(shape, dtype=sample.dtype, device=sample.device)
        self.values = torch.empty(shape, dtype=sample.dtype, device=sample.device)
        self.keys[:, 0].zero_()
        self.values[:, 0].zero_()
        self.capacity = capacity
        self._free = np.arange(capacity, 0, -1, dtype=np.int64)
        self._free_count = capacity

    def forget(self, namespace: str | None) -> None:
        """Free everything `namespace` holds (an adapter the engine no longer serves)."""
        with self._lock:
            root = self._roots.pop(namespace, None)
            stack = [] if root is None else list(root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self._release(node.slots)
                self.counters.evicted_tokens += len(node.slots)

    def _root(self, namespace: str | None, epoch: int) -> _Node:
        """`namespace`'s tree, made at its first use; notes `epoch` as the one it serves when newer."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node([], np.zeros(0, dtype=np.int64), None, epoch=epoch, version=-1)
        root.epoch = max(root.epoch, epoch)
        return root

    def _place(self, entry: Insert, namespace: str | None, epoch: int, tick: int) -> list[tuple[int, np.ndarray]]:
        """Walk `entry.tokens` into the tree, cutting a node where they branch off it, restamping runs of other weights
        and adding a leaf for the rest; returns (first token, slots) of each run whose keys and values to write."""
        tokens = entry.tokens
        writes: list[tuple[int, np.ndarray]] = []
        node, position = self._root(namespace, epoch), 0
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                break
            common = _common_length(child.tokens, tokens, position, len(tokens))
            usable = self.usable(child, epoch)
            if usable and position + common == len(tokens):  # ends inside a run the cache has: nothing to add
                child.last_used = tick
                return writes
            if common < len(child.tokens):
                child = self._split(child, common)
            if not usable:  # computed by other weights: this entry's keys and values replace them
                writes.append((position, child.slots))
                child.epoch, child.version = entry.epoch, entry.version
                self.counters.inserted_tokens += common
            child.last_used = tick
            node, position = child, position + common
        if position < len(tokens):
            run = self._take(len(tokens) - position, tick)
            if len(run):
                leaf = _Node(tokens[position : position + len(run)], run, node, entry.epoch, entry.version, tick)
                node.children[tokens[position]] = leaf
                writes.append((position, run))
                self.counters.inserted_tokens += len(run)
        return writes

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; returns the new head, which the rest hangs from."""
        assert node.parent is not None and 0 < at < len(node.tokens)
        head = _Node(node.tokens[:at], node.slots[:at], node.parent, node.epoch, node.version, node.last_used)
        node.parent.children[head.tokens[0]] = head
        node.tokens, node.slots, node.parent = node.tokens[at:], node.slots[at:], head
        head.children[node.tokens[0]] = node
        return head

    def _take(self, count: int, tick: int) -> np.ndarray:
        """Up to `count` free slots, evicting least recently used leaves for them first."""
        if self._free_count < count:
            self._evict(max(count, int(self.capacity * EVICTION_CHUNK)) - self._free_count, tick)
        count = min(count, self._free_count)
        run = self._free[self._free_count - count : self._free_count].copy()
        self._free_count -= count
        return run

    def _evict(self, wanted: int, tick: int) -> None:
        """Free at least `wanted` slots if leaves allow: those of weights their namespace no longer serves first, then
        the least recently used; never a node of the insert in progress (`tick`)."""
        order = itertools.count()
        heap = [(self.usable(leaf, root.epoch), leaf.last_used, next(order), leaf, root)
                for leaf, root in self._leaves() if leaf.last_used != tick]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < wanted:
            *_, leaf, root = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self._release(leaf.slots)
            freed += len(leaf.slots)
            if parent is not root and not parent.children and parent.last_used != tick:
                heapq.heappush(heap, (self.usable(parent, root.epoch), parent.last_used, next(order), parent, root))
        self.counters.evicted_tokens += freed

    def _release(self, slots: np.ndarray) -> None:
        self._free[self._free_count : self._free_count + len(slots)] = slots
        self._free_count += len(slots)

    def _leaves(self) -> list[tuple[_Node, _Node]]:
        """Every leaf, with the root of its namespace."""
        leaves = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                else:
                    leaves.append((node, root))
        return leaves

    def _write(self, rows: list[int], columns: list[torch.Tensor], slots: list[np.ndarray],
               keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Copy the keys and values at (row, column) pairs into their slots, one gather and one scatter per layer."""
        assert self.keys is not None and self.values is not None
        device = keys[0].device
        row_index = torch.cat([torch.full((len(run),), row, dtype=torch.int64) for row, run in zip(rows, slots,
                                                                                                  strict=True)])
        row_index = row_index.to(device)
        column_index = torch.cat(columns).to(device)
        target = torch.from_numpy(np.concatenate(slots)).to(self.keys.device)
        for layer, (layer_keys, layer_values) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer].index_copy_(0, target, layer_keys[row_index, :, column_index, :].to(self.keys.dtype))
            self.values[layer].index_copy_(0, target, layer_values[row_index, :, column_index, :].to(self.keys.dtype))

    def _write_routes(self, run: np.ndarray, table: torch.Tensor) -> None:
        if self.routes is None:
            self.routes = torch.zeros((self.capacity + 1, *table.shape[1:]), dtype=torch.int16)
        self.routes.index_copy_(0, torch.from_numpy(run), table.to(torch.int16))


def _common_length(edge: list[int], tokens: list[int], start: int, limit: int) -> int:
    """How many leading tokens of `edge` equal `tokens[start:limit]`."""
    span = min(len(edge), limit - start)
    if tokens[start : start + span] == edge[:span]:
        return span
    return next(index for index in range(span) if edge[index] != tokens[start + index])
