"""Each rollout worker's account of its engine's KV cache across weight updates, for the run's certificate.

A token sampled over keys and values an older weight version computed carries the new version's tag, so nothing
downstream can tell; only the engine can (`InferenceEngine.kv_cache_account`). The worker appends what its engine
says to RUN_DIR/metrics/kv_cache/ACTOR.jsonl after every weight update it lands and when it stops, one file per
worker (no two processes append to one file); `actors/report/integrity.py` turns the files into the `caches`
verdict. The counts are cumulative per process: a restarted worker starts again at zero under a new pid. An engine
with a prefix cache adds what it reused and prefilled (`prefix_cache`), which the certificate sums up beside the
verdict: the cache's tokens count in `stale_kv_tokens` like any other the moment a sample attends them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from actors.runtime.metrics import clock_fields
from engines.inference.base import InferenceEngine

FOLDER = Path("metrics") / "kv_cache"
# The prefix cache's cumulative counts a line carries (`engines.inference.base.PrefixCacheStats`).
PREFIX_CACHE_COUNTS = ("lookups", "hits", "reused_tokens", "prefilled_tokens", "stale_tokens", "reprefilled_tokens",
                       "evicted_tokens")


def record_kv_cache(run_dir: Path, actor_id: str, engine: InferenceEngine, version: int,
                    clock_origin: float | None = None) -> None:
    """Append the engine's account now; an engine that cannot account for its cache writes nothing. `clock_origin`:
    the run's clock, which a worker on the head node has (`ActorSettings.clock_origin`)."""
    account = engine.kv_cache_account()
    if account is None:
        return
    folder = run_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    line = {**clock_fields(clock_origin), "pid": os.getpid(), "version": version,
            "recomputes_on_update": account.recomputes_on_update, "stale_kv_tokens": account.stale_kv_tokens}
    stats = engine.prefix_cache_stats()
    if stats is not None:
        line["prefix_cache"] = {name: getattr(stats, name) for name in PREFIX_CACHE_COUNTS}
    with open(folder / f"{actor_id}.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")
