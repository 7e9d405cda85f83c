"""Do SGLang servers serve what the learner pushed? The verdict from SGLang's own weight checksums.

The torch engine fingerprints each pushed tensor as it serves it, and the learner compares tensor by tensor
(`engines/weights/fingerprint.py`). An SGLang server cannot: it loads the pushed tensors into its own layout (q/k/v
and gate/up fused, sharded across its tensor-parallel ranks, under its own names), and what it can tell is its
`/weights_checker` checksum of everything it serves in that layout (`protocol.WEIGHTS_CHECKER`). Each loader
writes that checksum, or why there is none, next to its acknowledgement (`ServedChecksum`), and the learner judges
the push with two comparisons that need no knowledge of the layout:

* consensus: the engines of one push run one model, launched alike, and load the same tensors, so they must serve
  the same checksum. Engines outside the largest agreeing group differ; when several groups tie for largest, no
  majority says which is right, and every engine in a disagreement is named.
* change: the sender fingerprints what it sends and keeps, from the last committed push, its prints and each
  engine's checksum (`Baseline`). If a tensor changed since and an engine's checksum did not, the update never
  reached that engine. This works with one engine.

* frozen tensors: SGLang also answers a checksum per tensor it serves. Each loader compares them with its server's
  answer after its previous load and reports the tensors that did not change (`ServedHistory`; a sharded tensor
  only when no rank's shard changed). A served tensor is made of the pushed tensors under its module, or under
  that module's parent where SGLang fuses (q/k/v into `qkv_proj`, a layer's experts into `experts.w13_weight`):
  its feeders. When every feeder changed since the last committed push and the served tensor did not, the server
  passed over what should have loaded it: SGLang's `load_weights` skips a name it does not know without a word (a
  MoE model's stacked experts were), and the other weights still move its checksum. Judged only for pushes whose
  tensors all travel in 16 bits: a server holds those bits exactly, where a float32 push may round to a server's
  bfloat16 and a small step then changes nothing there.

An engine is matched when it agrees with another engine, or when, alone, its checksum moved (or stayed) as the
pushed tensors did since the last committed push. Otherwise it is unchecked, with the reason: a first push to one
engine has nothing to compare with, and a server without the endpoint, or whose checksum failed, is unchecked too
(the weights did load: a failed checksum never fails a push). All engines serving the same wrong bits from the
first push on is not caught; a load that reached some engines and not others, or none, is.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engines.weights.fingerprint import FingerprintCheck, some

LAYOUT = "SGLang checksums its own fused, sharded layout: checked against other engines and its previous version only"


FROZEN_NAMES = 64  # frozen tensors a report names, first by name (it counts them all)
# What SGLang computes or keeps for itself rather than loads (the `_NON_PERSISTENT_BUFFER_PATTERNS` of its weight
# checker, every supported release together): such a tensor staying as it was says nothing.
SERVER_OWN_TENSORS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu",
                      "_weight_fp32")


@dataclass(frozen=True)
class ServedChecksum:
    """A loader's report after the load: its server's `per_engine_checksum`, or why there is none; and of the
    `tensors` it covers, those unchanged since the loader's previous report, at version `since` (`ServedHistory`):
    `frozen_count` of them, the first FROZEN_NAMES by name."""

    checksum: str | None
    why: str = ""
    tensors: int = 0
    since: int | None = None
    frozen: tuple[str, ...] = ()
    frozen_count: int = 0

    def encode(self) -> bytes:
        return json.dumps({"checksum": self.checksum, "why": self.why, "tensors": self.tensors, "since": self.since,
                           "frozen": list(self.frozen), "frozen_count": self.frozen_count},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> ServedChecksum:
        try:
            raw = json.loads(data)
            checksum, why = raw["checksum"], raw["why"]
            tensors, since, frozen, count = raw["tensors"], raw["since"], raw["frozen"], raw["frozen_count"]
            if (not (checksum is None or isinstance(checksum, str)) or not isinstance(why, str)
                    or not isinstance(tensors, int) or not (since is None or isinstance(since, int))
                    or not isinstance(frozen, list) or not all(isinstance(name, str) for name in frozen)
                    or not isinstance(count, int)):
                raise TypeError("values of the wrong type")
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"served checksum: unreadable ({error}): {data[:80]!r}") from error
        return cls(checksum, why, tensors, since, tuple(frozen), count)


class ServedHistory:
    """A loader's memory of its server's per-tensor checksums after its last checked load, to report which tensors
    the next load left as they were. A restarted server starts a new history (it serves its launch weights)."""

    def __init__(self) -> None:
        self._last: tuple[int, int, dict[str, str]] | None = None  # (server starts, version, tensor checksums)

    def report(self, checksum: str, tensors: Mapping[str, str], *, version: int, server_starts: int) -> ServedChecksum:
        """`tensors`: the server's checksum per tensor, `name@rank<r>` for a rank's shard (`protocol`)."""
        last, self._last = self._last, (server_starts, version, dict(tensors))
        if last is None or last[0] != server_starts or not tensors:
            return ServedChecksum(checksum, tensors=len(tensors))
        moved: dict[str, bool] = {}
        for key, value in tensors.items():
            name = key.split("@rank")[0]
            own = any(pattern in name for pattern in SERVER_OWN_TENSORS)
            moved[name] = moved.get(name, False) or own or last[2].get(key) != value
        frozen = sorted(name for name, changed in moved.items() if not changed)
        return ServedChecksum(checksum, tensors=len(moved), since=last[1], frozen=tuple(frozen[:FROZEN_NAMES]),
                              frozen_count=len(frozen))


@dataclass(frozen=True)
class Baseline:
    """The last committed push: its version, the sender's prints (with their algorithm) of what it sent, and each
    engine's checksum right after it."""

    version: int
    algorithm: str
    sent: Mapping[str, int]
    checksums: Mapping[str, str]


def check_checksums(algorithm: str, sent: Mapping[str, int], served: Mapping[str, ServedChecksum],
                    baseline: Baseline | None, *, sent_in_16_bits: bool = False) -> FingerprintCheck:
    """The push's verdict from the sender's prints of what it sent (`algorithm`), each engine's report, and the
    last committed push (None: none yet, or a new sender). `sent_in_16_bits`: every floating tensor travelled
    as bfloat16 or float16, so frozen served tensors are judged. See the module docstring."""
    if baseline is not None and baseline.algorithm != algorithm:
        baseline = None  # prints of another algorithm say nothing about what changed
    changed = changed_tensors(baseline.sent, sent) if baseline is not None else []
    unchecked = {engine: answer.why or "no checksum" for engine, answer in served.items() if answer.checksum is None}
    checksums = {engine: answer.checksum for engine, answer in served.items() if answer.checksum is not None}
    differ: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    if baseline is not None and changed:
        for engine, checksum in checksums.items():
            if baseline.checksums.get(engine) == checksum:
                differ[engine] = changed
                why[engine] = (f"serves the same weights as after version {baseline.version}: its SGLang checksum did "
                               f"not change although {len(changed)} pushed tensor(s) did, e.g. {some(changed)}")
    if baseline is not None and sent_in_16_bits and changed:
        moved = set(changed)
        for engine, answer in served.items():
            if engine in differ or answer.checksum is None or answer.since != baseline.version:
                continue
            stuck = [name for name in answer.frozen if (fed := feeders(name, sent)) and moved.issuperset(fed)]
            if stuck:
                differ[engine] = []
                why[engine] = (f"{len(stuck)} tensor(s) its server serves did not change since version "
                               f"{baseline.version} although every pushed tensor they are made of did, e.g. "
                               f"{some(stuck)}: its server passed over what should have loaded them (SGLang skips "
                               "a tensor name it does not know without a word)")
    rest = {engine: checksum for engine, checksum in checksums.items() if engine not in differ}
    for engine, others in disagreements(rest).items():
        differ[engine] = []
        why[engine] = (f"its SGLang checksum differs from that of {some(others)} (the engines of one push serve one "
                       "model in one layout)")
    matched: list[str] = []
    peers = _groups(rest)
    for engine, checksum in rest.items():
        if engine in differ:
            continue
        reason = None if len(peers[checksum]) > 1 else _against_itself(engine, checksum, baseline, changed)
        if reason is None:
            matched.append(engine)
        else:
            unchecked[engine] = reason
    return FingerprintCheck(algorithm, tuple(matched), differ, unchecked, why)


def feeders(served_name: str, sent: Iterable[str]) -> list[str]:
    """The pushed tensors a served tensor is made of, by name: those under its module, else under that module's
    parent (SGLang keeps the checkpoint's module names and fuses within a module: `self_attn.qkv_proj` from
    `self_attn.q_proj`..., `mlp.experts.w13_weight` from `mlp.experts.<e>.gate_proj`...)."""
    parts = served_name.split(".")
    for depth in (len(parts) - 1, len(parts) - 2):
        if depth < (1 if depth == len(parts) - 1 else 2):  # never the model's root: that is every tensor
            break
        prefix = ".".join(parts[:depth]) + "."
        found = [name for name in sent if name.startswith(prefix)]
        if found:
            return found
    return []


def changed_tensors(before: Mapping[str, int], now: Mapping[str, int]) -> list[str]:
    """The tensors whose prints differ between two pushes, or that only one of them sent."""
    return [name for name in now if before.get(name) != now[name]] + [name for name in before if name not in now]


def disagreements(checksums: Mapping[str, str]) -> dict[str, list[str]]:
    """Engines outside the largest group that agrees (all of them when groups tie for largest), each with the
    engines whose checksum is not its own."""
    groups = _groups(checksums)
    if len(groups) < 2:
        return {}
    largest = max(len(members) for members in groups.values())
    winners = [checksum for checksum, members in groups.items() if len(members) == largest]
    agreed = winners[0] if len(winners) == 1 else None
    return {engine: sorted(other for other, theirs in checksums.items() if theirs != checksum)
            for engine, checksum in checksums.items() if checksum != agreed}


def _groups(checksums: Mapping[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for engine, checksum in checksums.items():
        groups[checksum].append(engine)
    return groups


def _against_itself(engine: str, checksum: str, baseline: Baseline | None, changed: list[str]) -> str | None:
    """None when an engine no other engine agrees with moved with the pushed tensors since the last committed push
    (matched); else why it cannot be checked."""
    if baseline is None:
        return f"{LAYOUT}; first push, one engine"
    before = baseline.checksums.get(engine)
    if before is None:
        return f"{LAYOUT}; no other engine to compare with, and no checksum of its own from version {baseline.version}"
    if changed or before == checksum:
        return None  # changed with the tensors (an unchanged one is `differ` already), or stayed with them
    return (f"{LAYOUT}; its checksum changed since version {baseline.version} although no pushed tensor did (a "
            "restart, or weights outside the push), and no other engine to compare with")
