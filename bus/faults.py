"""Fault injection on the wire: drop, duplicate or delay outgoing bus messages, for the chaos matrix.

A plan is read once per process from ``SLIPSTREAM_BUS_FAULTS``, e.g.
``drop=0.02,duplicate=0.02,delay=0.05,delay_ms=20-200,seed=7``: each outgoing message (a whole multipart message,
never one frame of it) is independently dropped, sent twice, or held back for a uniform random time in
``delay_ms`` and sent later from the event loop, so delayed messages overtake nothing but may be overtaken
(reordering). Probabilities are per message and must sum to at most 1. With no plan ``make_socket`` creates
plain sockets: nothing here is on the hot path of a normal run.

Every channel's outgoing messages are eligible, control frames included: the stream channel's hello and credit
(its limits are cumulative and a starved sender re-sends its hello, so a lost or repeated one costs time, not
correctness), RPC requests and replies (retries reuse the request id and replies are cached, so a lost request
or reply is a retry and a repeated one is answered from the cache), broadcasts (states, not events: the next
publish or a re-subscription brings the latest). Two consequences worth knowing when reading a chaos run: a
dropped stream *data* frame costs its sender one credit for the rest of that session (no real socket loses a
frame of a live connection, so the protocol does not count them), and a send that reports success may have been
dropped (``RpcServer.reaches`` then reads a detached client as attached; its caller retries).

Counts (messages seen, dropped, duplicated, delayed) are kept per process (``counts()``). With
``SLIPSTREAM_BUS_FAULTS_REPORT=DIR`` each process also keeps ``DIR/faults-PID.json`` up to date (within half a
second, and at exit), so a tool can add up what a whole multi-process run injected, even across kill -9.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

PLAN_ENV = "SLIPSTREAM_BUS_FAULTS"
REPORT_ENV = "SLIPSTREAM_BUS_FAULTS_REPORT"
REPORT_EVERY_S = 0.5
_KEYS = ("drop", "duplicate", "delay", "delay_ms", "seed")


class FaultPlanError(ValueError):
    """A plan that cannot be used; the message names the item at fault."""


@dataclass(frozen=True)
class FaultPlan:
    """Per-message probabilities of each fault, the delay range in milliseconds, and the random seed."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    delay_ms: tuple[float, float] = (20.0, 200.0)
    seed: int = 0

    @classmethod
    def parse(cls, text: str, *, source: str = PLAN_ENV) -> FaultPlan:
        """``key=value`` items separated by commas; ``delay_ms`` is ``LO-HI`` or one number."""
        values: dict[str, Any] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or not raw:
                raise FaultPlanError(f"{source} item {item!r}: expected key=value")
            if key not in _KEYS:
                raise FaultPlanError(f"{source} item {item!r}: unknown key {key!r} (known: {', '.join(_KEYS)})")
            if key in values:
                raise FaultPlanError(f"{source} item {item!r}: {key} given twice")
            try:
                values[key] = _parse_value(key, raw)
            except ValueError as error:
                raise FaultPlanError(f"{source} item {item!r}: {error}") from None
        if not values:
            raise FaultPlanError(f"{source} is set but holds no item (e.g. drop=0.02,duplicate=0.02)")
        plan = cls(**values)
        if plan.drop + plan.duplicate + plan.delay > 1.0:
            raise FaultPlanError(f"{source} {text!r}: drop + duplicate + delay = "
                                 f"{plan.drop + plan.duplicate + plan.delay:g} > 1")
        return plan

    def describe(self) -> str:
        lo, hi = self.delay_ms
        return (f"drop={self.drop:g},duplicate={self.duplicate:g},delay={self.delay:g},delay_ms={lo:g}-{hi:g},"
                f"seed={self.seed}")


def _parse_value(key: str, raw: str) -> Any:
    if key == "seed":
        return int(raw)
    if key == "delay_ms":
        lo_text, _, hi_text = raw.partition("-")
        lo = float(lo_text)
        hi = float(hi_text) if hi_text else lo
        if not 0 <= lo <= hi:
            raise ValueError(f"need 0 <= LO <= HI milliseconds, got {raw!r}")
        return (lo, hi)
    probability = float(raw)
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"a probability must be in [0, 1], got {raw!r}")
    return probability


class Fate(Enum):
    SEND = "sent"
    DROP = "dropped"
    DUPLICATE = "duplicated"
    DELAY = "delayed"


class FaultInjector:
    """One process's decisions under a plan, and the counts of what it did."""

    def __init__(self, plan: FaultPlan, report_dir: Path | None = None, *, salt: str | None = None) -> None:
        self.plan = plan
        self.counts: Counter[str] = Counter()
        # Salted with the pid by default: forked actors would otherwise share one sequence of decisions.
        self._rng = random.Random(f"{plan.seed}:{os.getpid() if salt is None else salt}")
        self._report = report_dir / f"faults-{os.getpid()}.json" if report_dir is not None else None
        self._flush_scheduled = False
        if self._report is not None:
            report_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            atexit.register(self.flush)

    def decide(self, kind: str) -> tuple[Fate, float]:
        """The fate of one message on a socket of type ``kind`` and, for a delay, the seconds to hold it."""
        plan = self.plan
        draw = self._rng.random()
        if draw < plan.drop:
            fate = Fate.DROP
        elif draw < plan.drop + plan.duplicate:
            fate = Fate.DUPLICATE
        elif draw < plan.drop + plan.duplicate + plan.delay:
            fate = Fate.DELAY
        else:
            fate = Fate.SEND
        self.counts["messages"] += 1
        if fate is Fate.SEND:
            return fate, 0.0
        self.count(fate.value, kind)
        lo, hi = plan.delay_ms
        return fate, self._rng.uniform(lo, hi) / 1000.0 if fate is Fate.DELAY else 0.0

    def count(self, what: str, kind: str) -> None:
        self.counts[what] += 1
        self.counts[f"{what}.{kind}"] += 1
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._report is None or self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_later(REPORT_EVERY_S, self.flush)

    def flush(self) -> None:
        """Write this process's counts (atomically: a reader never sees half a file)."""
        self._flush_scheduled = False
        if self._report is None:
            return
        record = {"pid": os.getpid(), "plan": self.plan.describe(), "time": time.time(), "counts": dict(self.counts)}
        temporary = self._report.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(record), encoding="utf-8")
            os.replace(temporary, self._report)


def _snapshot(part: Any) -> bytes:
    """An immutable copy of one frame, for a send that happens after the caller may reuse its buffer."""
    return part.bytes if isinstance(part, zmq.Frame) else bytes(part)


_KIND_NAMES = {getattr(zmq, name): name for name in ("DEALER", "ROUTER", "XPUB", "PUB", "SUB", "PUSH", "PULL")}


class FaultySocket(zmq.asyncio.Socket):
    """An asyncio socket whose outgoing messages meet the process's plan; ``sync_view()`` gives the stream
    channel's synchronous view of it, under the same plan."""

    _injector: FaultInjector
    _kind_name: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        injector = active_injector()
        if injector is None:
            raise RuntimeError("FaultySocket created without a fault plan")
        self._injector = injector
        self._kind_name = _KIND_NAMES.get(self.type, str(self.type))

    def send_multipart(self, msg_parts: Any, flags: int = 0, copy: bool = True, track: bool = False,
                       **kwargs: Any) -> Any:
        fate, delay = self._injector.decide(self._kind_name)
        if fate is Fate.SEND:
            return super().send_multipart(msg_parts, flags=flags, copy=copy, track=track, **kwargs)
        if fate is Fate.DUPLICATE:
            copies = [_snapshot(part) for part in msg_parts]
            sent = super().send_multipart(msg_parts, flags=flags, copy=copy, track=track, **kwargs)
            self.send_later(copies, 0.0)
            return sent
        if fate is Fate.DELAY:
            self.send_later([_snapshot(part) for part in msg_parts], delay)
        return self._done()

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False, **kwargs: Any) -> Any:
        if flags & zmq.SNDMORE:
            return super().send(data, flags=flags, copy=copy, track=track, **kwargs)
        return self.send_multipart([data], flags=flags, copy=copy, track=track, **kwargs)

    def send_later(self, frames: list[bytes], delay: float) -> None:
        """Send a copy from the event loop after ``delay`` seconds (0: at once), without waiting; a copy that
        cannot be sent then (socket closed, peer gone, queue full) is counted as lost."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or delay <= 0:
            self._send_copy(frames)
        else:
            loop.call_later(delay, self._send_copy, frames)

    def _send_copy(self, frames: list[bytes]) -> None:
        if self.closed:
            self._injector.count("lost_copies", self._kind_name)
            return
        try:
            future = super().send_multipart(frames, flags=zmq.DONTWAIT)
        except zmq.ZMQError:
            self._injector.count("lost_copies", self._kind_name)
            return
        future.add_done_callback(self._count_failed_copy)

    def _count_failed_copy(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self._injector.count("lost_copies", self._kind_name)

    def _done(self) -> asyncio.Future[None]:
        future: asyncio.Future[None] = self._Future()
        future.set_result(None)
        return future

    def sync_view(self) -> FaultySyncSocket:
        view = FaultySyncSocket.shadow(self.underlying)
        view._owner = self
        view._injector = self._injector
        return view


class FaultySyncSocket(zmq.Socket):
    """The synchronous view of a ``FaultySocket`` (the stream channel's non-blocking fast path); delayed copies
    leave through the asyncio socket, which keeps pyzmq's wake-ups of waiting receives right."""

    _owner: FaultySocket
    _injector: FaultInjector
    _whole: bool = False  # inside our own send_multipart: its frames are already decided

    def send_multipart(self, msg_parts: Any, flags: int = 0, copy: bool = True, track: bool = False,
                       **kwargs: Any) -> Any:
        fate, delay = self._injector.decide(self._owner._kind_name)
        if fate is Fate.DROP:
            return None
        if fate is Fate.DELAY:
            self._owner.send_later([_snapshot(part) for part in msg_parts], delay)
            return None
        copies = [_snapshot(part) for part in msg_parts] if fate is Fate.DUPLICATE else None
        self._whole = True
        try:
            sent = super().send_multipart(msg_parts, flags=flags, copy=copy, track=track, **kwargs)
        finally:
            self._whole = False
        if copies is not None:
            self._owner.send_later(copies, 0.0)
        return sent

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False, **kwargs: Any) -> Any:
        if self._whole or flags & zmq.SNDMORE:
            return super().send(data, flags=flags, copy=copy, track=track, **kwargs)
        return self.send_multipart([data], flags=flags, copy=copy, track=track, **kwargs)


# ------------------------------------------------------------------------------------- the process's plan
_UNREAD: Any = object()
_injector: FaultInjector | None = _UNREAD


def active_injector() -> FaultInjector | None:
    """This process's injector, built from the environment at the first call (None: no plan)."""
    global _injector
    if _injector is _UNREAD:
        text = os.environ.get(PLAN_ENV, "").strip()
        report = os.environ.get(REPORT_ENV, "").strip()
        _injector = FaultInjector(FaultPlan.parse(text), Path(report) if report else None) if text else None
    return _injector


def socket_class() -> type[FaultySocket] | None:
    """The class ``make_socket`` creates sockets with: ``FaultySocket`` under a plan, else None (the default)."""
    return None if active_injector() is None else FaultySocket


def sync_view(sock: zmq.asyncio.Socket) -> zmq.Socket:
    """A synchronous view of ``sock`` for non-blocking calls; under a plan it injects the same faults."""
    if isinstance(sock, FaultySocket):
        return sock.sync_view()
    return zmq.Socket.shadow(sock.underlying)


def counts() -> dict[str, int]:
    """What this process's sockets have done under the plan so far (empty without one)."""
    injector = active_injector()
    return dict(injector.counts) if injector is not None else {}


def reload() -> None:
    """Forget the plan read so far: the next socket reads the environment again. A forked child does this (its own
    environment, counts and random stream); so do tests that change the plan."""
    global _injector
    _injector = _UNREAD


os.register_at_fork(after_in_child=reload)
