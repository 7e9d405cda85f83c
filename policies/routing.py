"""Which engine a generate call goes to: pure functions of the run's engines and the work each has outstanding.

Every rollout worker routes its own calls (`actors/rollout/router.py`); because the choice depends only on the
engines in the roster and on load, two workers asking about the same key with the same view of the run pick the
same engine, with no router process in between.

Policies (`--router-policy`):

- `affinity`: a call with a routing key (an agent episode's session, a group's id) goes to the key's owner on a
  consistent-hash ring of the engines, so a session's turns land where its keys and values already are; engines
  joining or leaving move only the keys whose owner they are or become (about 1/n of them). The load is bounded:
  an engine whose outstanding work would pass (1 + slack) x the mean is skipped for the next engine on the ring
  (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, 2018). A call without a key has the
  worker's own engine for its owner under the same bound, then the least loaded: no hop while the local engine is
  not overloaded (each worker leases only what its own engine holds, so that is the common case), least outstanding
  work once it is.
- `least-load`: every call to the engine with the least outstanding work (slime's own router's rule).
- `round-robin`: every call to the next engine in turn (the baseline that ignores both cache and load).
- `local`: every call to the worker's own engine (each session pinned to one engine, as before routing existed).

Load is outstanding sequences (a request for n samples weighs n); ties go to the local engine (no hop), then in
turn.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

RouterPolicy = Literal["affinity", "least-load", "round-robin", "local"]
ROUTER_POLICIES: tuple[str, ...] = ("affinity", "least-load", "round-robin", "local")
POINTS_PER_ENGINE = 128  # virtual nodes: with 128 each, an engine of 4 to 16 owns within a quarter of 1/n of the keys


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class HashRing:
    """Engines placed on a ring of 64-bit hashes, `POINTS_PER_ENGINE` points each; a key belongs to the first
    engine clockwise from its own hash. Only engine names go in, so every worker builds the same ring."""

    hashes: tuple[int, ...]
    owners: tuple[str, ...]

    @classmethod
    def of(cls, engines: Iterable[str], points: int = POINTS_PER_ENGINE) -> HashRing:
        if points < 1:
            raise ValueError(f"HashRing: points per engine must be >= 1, got {points}")
        placed = sorted((_hash(f"{engine}#{point}"), engine) for engine in set(engines) for point in range(points))
        return cls(tuple(h for h, _ in placed), tuple(engine for _, engine in placed))

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.owners)))

    def walk(self, key: str) -> list[str]:
        """Every engine once, in ring order from `key`'s owner: where the key goes, then where it spills over."""
        if not self.hashes:
            return []
        start = bisect.bisect(self.hashes, _hash(key)) % len(self.hashes)
        order: list[str] = []
        seen: set[str] = set()
        count = len(set(self.owners))
        for offset in range(len(self.owners)):
            engine = self.owners[(start + offset) % len(self.owners)]
            if engine not in seen:
                seen.add(engine)
                order.append(engine)
                if len(order) == count:
                    break
        return order

    def owner(self, key: str) -> str:
        order = self.walk(key)
        if not order:
            raise ValueError("HashRing.owner: the ring has no engines")
        return order[0]


def bounded_load_choice(order: Sequence[str], loads: Mapping[str, float], slack: float, weight: float = 1.0) -> str:
    """The first engine of `order` (a key's ring walk) that can take `weight` more work within the bound
    (1 + slack) x the mean load counting the new work; an idle engine always can. When big calls leave none within
    it, the least loaded (earliest in `order` on a tie)."""
    if not order:
        raise ValueError("bounded_load_choice: no engine to choose from")
    if slack < 0:
        raise ValueError(f"bounded_load_choice: slack must be >= 0, got {slack}")
    total = sum(loads.get(engine, 0.0) for engine in order) + weight
    bound = (1.0 + slack) * total / len(order)
    for engine in order:
        load = loads.get(engine, 0.0)
        if load == 0 or load + weight <= bound + 1e-9:
            return engine
    return min(order, key=lambda engine: loads.get(engine, 0.0))


def least_loaded(engines: Sequence[str], loads: Mapping[str, float], *, local: str | None, turn: int) -> str:
    """The engine with the least outstanding work; on a tie the local one, else the tied engines in turn."""
    if not engines:
        raise ValueError("least_loaded: no engine to choose from")
    fewest = min(loads.get(engine, 0.0) for engine in engines)
    tied = sorted(engine for engine in engines if math.isclose(loads.get(engine, 0.0), fewest))
    if local in tied:
        return local  # type: ignore[return-value]
    return tied[turn % len(tied)]


def choose_engine(policy: str, key: str | None, ring: HashRing, loads: Mapping[str, float], *, local: str,
                  turn: int, slack: float, weight: float = 1.0, excluded: Iterable[str] = ()) -> str:
    """The engine for one call under `policy`, among the ring's engines less `excluded` (those a failed attempt
    of this call already tried). `turn` counts the caller's calls: round-robin and ties advance with it."""
    left = set(excluded)
    engines = [engine for engine in ring.engines if engine not in left]
    if not engines:
        raise LookupError(f"no engine left to route to: {len(ring.engines)} in the run, {len(left)} tried")
    if policy == "local":
        if local in engines:
            return local
        raise LookupError(f"--router-policy local: the local engine {local} is not available")
    if policy == "round-robin":
        return engines[turn % len(engines)]
    if policy == "least-load":
        return least_loaded(engines, loads, local=local, turn=turn)
    if policy == "affinity":
        if key is None:
            others = sorted((engine for engine in engines if engine != local), key=lambda e: loads.get(e, 0.0))
            order = [local, *others] if local in engines else others
        else:
            order = [engine for engine in ring.walk(key) if engine not in left]
        return bounded_load_choice(order, loads, slack, weight)
    raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(ROUTER_POLICIES)}")
