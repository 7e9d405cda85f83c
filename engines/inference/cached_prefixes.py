"""What the torch engine's batcher keeps in, and takes from, the prefix cache (`prefix_cache.py`), and the weight
epochs that say which of it is still usable: a mixin of `ContinuousBatcher`, whose prefill reads it and whose
eviction feeds it.

Every load of weights is an epoch, a repush of the same version included, and keys and values are reused in the
epoch they were computed in only. A named adapter's rows compute other keys and values from the same tokens, so
each adapter has its own part of the cache (its namespace) and its own epoch: the newest load of the base weights
or of that adapter. Loading one policy's adapter voids that adapter's entries and no other's.
"""

from __future__ import annotations

import torch

from engines.inference.base import PrefixCacheStats
from engines.inference.decoding_sequence import DecodingSequence
from engines.inference.kv_batch import KVBatch
from engines.inference.prefix_cache import Insert, PrefixCache, PrefixMatch


class CachedPrefixes:
    """The batcher's side of the prefix cache. The batcher sets the attributes below and gives the rows' keys and
    values in its layout (`_row_kv`, `_row_columns`)."""

    prefix_cache: PrefixCache | None
    loads: int  # weight loads so far, each an epoch
    weights_epoch: int  # the base weights' newest load
    adapter_epochs: dict[str, int]  # each named adapter's newest load
    reprefilled_tokens: int  # in-flight tokens prefilled again after an update dropped their rows

    def _row_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        raise NotImplementedError

    def _row_columns(self, rows: list[int], counts: list[int]) -> list[torch.Tensor]:
        raise NotImplementedError

    def weights_loaded(self, adapter: str | None) -> None:
        """A load of the base weights (None) or of a named adapter: a new epoch for the keys and values it changes."""
        self.loads += 1
        if adapter is None:
            self.weights_epoch = self.loads
        else:
            self.adapter_epochs[adapter] = self.loads

    def epoch_of(self, adapter: str | None) -> int:
        """The epoch of the weights a row of `adapter` computes keys and values with: the newest load of the base
        weights or of the adapter."""
        return self.weights_epoch if adapter is None else max(self.weights_epoch, self.adapter_epochs.get(adapter, 0))

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        cache = self.prefix_cache
        if cache is None:
            return None
        counters = cache.counters
        return PrefixCacheStats(
            lookups=counters.lookups, hits=counters.hits, reused_tokens=counters.reused_tokens,
            prefilled_tokens=counters.prefilled_tokens, stale_tokens=counters.stale_tokens,
            reprefilled_tokens=self.reprefilled_tokens, evicted_tokens=counters.evicted_tokens,
            held_tokens=cache.held_tokens, capacity_tokens=cache.capacity)

    def release_prefix_cache(self) -> None:
        """Give the prefix cache's memory back (a colocated engine hands its device over, or a step failed)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _uncached_length(self, tokens: list[int], adapter: str | None) -> int:
        """How many tokens of `tokens` a prefill would compute (what the prefix cache holds of it is not)."""
        return len(tokens) - self._cached(tokens, adapter, touch=False).length

    def _cached(self, tokens: list[int], adapter: str | None, *, touch: bool = True) -> PrefixMatch:
        """What the prefix cache holds of `tokens` at the weights `adapter`'s rows are served, leaving the last one to
        compute (its logits give the next token)."""
        if self.prefix_cache is None:
            return PrefixMatch()
        return self.prefix_cache.match(tokens, self.epoch_of(adapter), namespace=adapter, limit=len(tokens) - 1,
                                       touch=touch)

    def _keep_prefilled(self, batch: KVBatch, sequences: list[list[int]], rows: list[int],
                        stamps: list[tuple[int, int]], routes: list[torch.Tensor | None],
                        adapters: list[str | None]) -> None:
        """Keep every prefilled sequence in the prefix cache, all of its tokens (a prefill computes the last one's keys
        and values too): a group's other samples, arriving later, start with it."""
        in_rows = sorted(range(len(sequences)), key=rows.__getitem__)
        mask = batch.attention_mask
        if len(sequences) < batch.rows:  # some rows are not kept (images: vision_rows.py)
            mask = mask.index_select(0, torch.tensor(sorted(rows), dtype=torch.int64, device=mask.device))
        columns = real_columns(mask, [len(sequences[index]) for index in in_rows])
        entries = [(adapters[index], Insert(sequences[index], rows[index], row_columns, *stamps[index], routes[index]))
                   for index, row_columns in zip(in_rows, columns, strict=True)]
        self._insert(entries, *_layer_kv(batch))

    def _remember_leaving(self, leaving: list[tuple[int, DecodingSequence]]) -> None:
        """Keep what leaving rows computed (prompt and output but the last token, which was never fed) in the prefix
        cache: the next turn of a conversation, or a resumed sample, starts with it."""
        leaving = [(row, sample) for row, sample in leaving if sample.vision is None]  # vision_rows.py: why
        if self.prefix_cache is None or not leaving:
            return
        tokens = [sample.prompt_ids + sample.output_ids[:-1] for _, sample in leaving]
        columns = self._row_columns([row for row, _ in leaving], [len(sequence) for sequence in tokens])
        entries = []
        for (row, sample), sequence, row_columns in zip(leaving, tokens, columns, strict=True):
            if sample.kv_version is None or sample.kv_epoch is None:
                continue
            routes = torch.cat(sample.routes)[: len(sequence)] if sample.routes else None
            entries.append((sample.adapter, Insert(sequence, row, row_columns, sample.kv_version, sample.kv_epoch,
                                                   routes)))
        self._insert(entries, *self._row_kv())

    def _insert(self, entries: list[tuple[str | None, Insert]], keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> None:
        """Keep `entries` in the prefix cache, each in its adapter's part, at the epoch that adapter's rows serve."""
        assert self.prefix_cache is not None
        for adapter in dict.fromkeys(adapter for adapter, _ in entries):
            self.prefix_cache.insert([entry for owner, entry in entries if owner == adapter], keys, values,
                                     self.epoch_of(adapter), namespace=adapter)


def real_columns(mask: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """The columns that hold tokens in each row of `mask` ([rows, columns], nonzero = a token), in order; row i must
    hold `counts[i]`: a cache that holds another number of tokens than its sequence has is a bug, never cached."""
    held = (mask != 0).sum(dim=1).tolist()
    if held != counts:
        raise RuntimeError(f"KV cache rows hold {held} tokens, their sequences {counts}")
    return list(mask.nonzero()[:, 1].split(counts))


def _layer_kv(batch: KVBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = batch._layers()
    return [layer.keys for layer in layers], [layer.values for layer in layers]
