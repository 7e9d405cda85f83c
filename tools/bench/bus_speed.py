"""Benchmark: the bus stream channel against raw pyzmq + msgpack PUSH/PULL (the ceiling) and Ray actor calls.

    python -m tools.bench.bus_speed                  # 1 KB, ~100 KB and ~4 MB payloads over tcp loopback and ipc
    python -m tools.bench.bus_speed --quick          # a few hundred messages, no Ray: the smoke test
    python -m tools.bench.bus_speed --json out.json

Payloads are real messages: a short ``Sample`` (~1 KB), an RL sample of 8k token ids with float32 log-probs,
token versions and a loss mask (~100 KB), and a ``Batch`` of 40 such samples (~4 MB). Every system encodes
each message before sending it and decodes it fully on arrival (the bus also validates the schema and returns
credits); raw sends the same fields as a msgpack map with the arrays as bin, through unthrottled PUSH/PULL.
Sender and receiver are separate processes; Ray runs the same payload (numpy arrays in a dict) from one actor
to another with at most 16 calls in flight, the bus's default credit window.

Throughput: messages received per second once warm. Latency: one message in flight (bus window 1, raw waits
for an ack, Ray waits for the call), measured one way from the send stamp to the end of decoding, on the
machine-wide monotonic clock. Systems alternate within each repeat; the table shows medians over repeats.
A codec table compares the bus codec (msgspec, typed, validating) with msgpack-python, with and without the
same validation, on the same messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from bus.codec import decode, encode
from bus.schema import AnyMessage, Batch, Message, Sample
from bus.tensors import decode_tensor
from tools.bench.bus_speed_ray import ray_available, run_ray

PAYLOADS = ("1KB", "100KB", "4MB")
TRANSPORTS = ("tcp", "ipc")


# ---------------------------------------------------------------------------------------------------------------
# Payloads
# ---------------------------------------------------------------------------------------------------------------


def _sample(index: int, prompt_tokens: int, response_tokens: int) -> Sample:
    rng = np.random.default_rng(index)
    total = prompt_tokens + response_tokens
    return Sample(
        sample_id=f"group-{index // 8}/{index % 8}",
        group_id=f"group-{index // 8}",
        index=index % 8,
        prompt="Solve: what is 17 * 23? Think step by step and put the answer in a box.",
        prompt_tokens=prompt_tokens,
        tokens=rng.integers(0, 150_000, total, dtype=np.int32),
        response="The answer is 391." if response_tokens < 1000 else "",
        response_length=response_tokens,
        label="391",
        reward=1.0,
        loss_mask=np.ones(response_tokens, dtype=np.uint8),
        rollout_log_probs=rng.standard_normal(response_tokens).astype(np.float32),
        token_versions=np.full(response_tokens, 7, dtype=np.int32),
        status="completed",
        metadata={"finish_reason": "stop", "t": 0.0},
    )


def make_message(payload: str) -> Message:
    if payload == "1KB":
        return _sample(0, 28, 100)
    if payload == "100KB":
        return _sample(0, 512, 7680)
    if payload == "4MB":
        samples = [_sample(i, 512, 7680) for i in range(40)]
        return Batch(batch_id=1, samples=samples, staleness=[1] * 40, learner_version=8)
    raise ValueError(f"unknown payload {payload!r}; choose from {', '.join(PAYLOADS)}")


def _raw_sample(sample: Sample) -> dict[str, Any]:
    """The same fields as a plain msgpack map, arrays as bin: what a hand-rolled protocol would send."""
    out: dict[str, Any] = {}
    for name in sample.__struct_fields__:
        value = getattr(sample, name)
        out[name] = value.tobytes() if isinstance(value, np.ndarray) else value
    return out


def make_raw(payload: str) -> dict[str, Any]:
    message = make_message(payload)
    if isinstance(message, Batch):
        return {"batch_id": message.batch_id, "samples": [_raw_sample(s) for s in message.samples], "t": 0.0}
    return {**_raw_sample(message), "t": 0.0}


def make_ray_payload(payload: str) -> dict[str, Any]:
    message = make_message(payload)
    samples = message.samples if isinstance(message, Batch) else [message]
    as_dicts = [{name: getattr(s, name) for name in s.__struct_fields__} for s in samples]
    return {"samples": as_dicts, "t": 0.0}


def _stamp_carrier(message: Message) -> dict[str, Any]:
    """Where the send time rides: a sample's metadata (a Batch's first sample), already part of the payload."""
    return (message.samples[0] if isinstance(message, Batch) else message).metadata


def _stamp(message: Message, t: float) -> None:
    _stamp_carrier(message)["t"] = t


def _stamp_of(message: Message) -> float:
    return _stamp_carrier(message)["t"]


# ---------------------------------------------------------------------------------------------------------------
# Worker processes: one receives, one sends; the parent tells them what to run
# ---------------------------------------------------------------------------------------------------------------


async def _bus_receive(conn: Connection, bind: str, mode: str, n: int, warmup: int, window: int) -> dict[str, Any]:
    import zmq.asyncio

    from bus.stream import StreamReceiver

    ctx = zmq.asyncio.Context()
    receiver = StreamReceiver(ctx, bind, window=window if mode == "throughput" else 1)
    conn.send(receiver.endpoint)
    try:
        for _ in range(warmup):
            await receiver.recv()
        if mode == "throughput":
            await receiver.recv()
            start, cpu = time.monotonic(), time.process_time()
            for _ in range(n - 1):
                await receiver.recv()
            elapsed, cpu = time.monotonic() - start, time.process_time() - cpu
            return {"rate": (n - 1) / elapsed, "cpu_us": cpu / (n - 1) * 1e6}
        latencies = []
        for _ in range(n):
            _, message = await receiver.recv()
            latencies.append(time.monotonic() - _stamp_of(message))
        return {"latencies": latencies}
    finally:
        receiver.close()
        ctx.destroy(linger=0)


async def _bus_send(conn: Connection, endpoint: str, payload: str, count: int, mode: str) -> None:
    import zmq.asyncio

    from bus.stream import StreamSender

    ctx = zmq.asyncio.Context()
    sender = StreamSender(ctx, sender_id="bench-sender")
    sender.connect("receiver", endpoint)
    message = make_message(payload)
    cpu = time.process_time()
    for _ in range(count):
        if mode == "latency":
            await sender.wait_for_credit()  # window 1: the previous message has been decoded
        _stamp(message, time.monotonic())
        await sender.send(message)
    conn.send({"cpu_us": (time.process_time() - cpu) / count * 1e6})
    conn.recv()  # the receiver has everything: only now may the socket close (linger 0 drops unsent frames)
    sender.close()
    ctx.destroy(linger=0)


def _raw_receive(conn: Connection, bind: str, mode: str, n: int, warmup: int, window: int) -> dict[str, Any]:
    import zmq

    ctx = zmq.Context()
    pull, acks = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(bind)
    acks.bind(bind.replace(".sock", "-ack.sock") if bind.startswith("ipc") else bind)
    conn.send((pull.getsockopt_string(zmq.LAST_ENDPOINT), acks.getsockopt_string(zmq.LAST_ENDPOINT)))
    try:
        if mode == "throughput":
            for _ in range(warmup):
                msgpack.unpackb(pull.recv(copy=False).buffer)
            msgpack.unpackb(pull.recv(copy=False).buffer)
            start, cpu = time.monotonic(), time.process_time()
            for _ in range(n - 1):
                msgpack.unpackb(pull.recv(copy=False).buffer)
            elapsed, cpu = time.monotonic() - start, time.process_time() - cpu
            return {"rate": (n - 1) / elapsed, "cpu_us": cpu / (n - 1) * 1e6}
        latencies = []
        for i in range(warmup + n):
            message = msgpack.unpackb(pull.recv(copy=False).buffer)
            if i >= warmup:
                latencies.append(time.monotonic() - message["t"])
            acks.send(b"")
        return {"latencies": latencies}
    finally:
        ctx.destroy(linger=0)


def _raw_send(conn: Connection, endpoints: tuple[str, str], payload: str, count: int, mode: str) -> None:
    import zmq

    ctx = zmq.Context()
    push, acks = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.connect(endpoints[0])
    acks.connect(endpoints[1])
    message = make_raw(payload)
    cpu = time.process_time()
    for _ in range(count):
        message["t"] = time.monotonic()
        push.send(msgpack.packb(message), copy=False)
        if mode == "latency":
            acks.recv()
    conn.send({"cpu_us": (time.process_time() - cpu) / count * 1e6})
    conn.recv()
    ctx.destroy(linger=0)


def _worker(conn: Connection, use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        uvloop.install()
    while True:
        command = conn.recv()
        if command is None:
            return
        kind, args = command
        if kind == "bus_receive":
            conn.send(asyncio.run(_bus_receive(conn, **args)))
        elif kind == "bus_send":
            asyncio.run(_bus_send(conn, **args))
        elif kind == "raw_receive":
            conn.send(_raw_receive(conn, **args))
        elif kind == "raw_send":
            _raw_send(conn, **args)


class Pair:
    """A long-lived receiver process and sender process, so no trial pays for process start-up."""

    def __init__(self, use_uvloop: bool) -> None:
        ctx = mp.get_context("spawn")
        self.receiver, receiver_end = ctx.Pipe()
        self.sender, sender_end = ctx.Pipe()
        self.processes = [
            ctx.Process(target=_worker, args=(end, use_uvloop), daemon=True) for end in (receiver_end, sender_end)
        ]
        for process in self.processes:
            process.start()

    def trial(
        self, system: str, transport: str, payload: str, mode: str, n: int, warmup: int, window: int
    ) -> dict[str, Any]:
        run_dir = tempfile.mkdtemp(prefix="bb-", dir="/tmp")  # short: ipc paths are limited to 107 bytes
        try:
            bind = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{run_dir}/r.sock"
            receive = {"bind": bind, "mode": mode, "n": n, "warmup": warmup, "window": window}
            self.receiver.send((f"{system}_receive", receive))
            endpoint = self.receiver.recv()
            args: dict[str, Any] = {"endpoint" if system == "bus" else "endpoints": endpoint}
            args.update(payload=payload, count=n + warmup, mode=mode)
            self.sender.send((f"{system}_send", args))
            result = self.receiver.recv()
            sender = self.sender.recv()
            self.sender.send("close")
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        if "cpu_us" in result:
            result["cpu_us"] += sender["cpu_us"]
        return result

    def close(self) -> None:
        for conn in (self.receiver, self.sender):
            conn.send(None)
        for process in self.processes:
            process.join(timeout=10)


# ---------------------------------------------------------------------------------------------------------------
# Codec microbenchmark
# ---------------------------------------------------------------------------------------------------------------


def _time_per_call(fn: Any, budget_s: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def codec_rows(payloads: tuple[str, ...], budget_s: float, repeats: int) -> list[dict[str, Any]]:
    import msgspec

    def hand_validated(frame: bytes) -> Message:
        def ext_hook(code: int, data: bytes) -> Any:
            return decode_tensor(code, memoryview(data), 1 << 30)

        return msgspec.convert(msgpack.unpackb(frame, ext_hook=ext_hook), AnyMessage)

    rows = []
    for payload in payloads:
        message, raw = make_message(payload), make_raw(payload)
        frame, raw_frame = encode(message), msgpack.packb(raw)
        timings: dict[str, list[float]] = {k: [] for k in ("bus_enc", "bus_dec", "mp_enc", "mp_dec", "mp_val_dec")}
        for _ in range(repeats):
            timings["bus_enc"].append(_time_per_call(lambda m=message: encode(m), budget_s))
            timings["mp_enc"].append(_time_per_call(lambda r=raw: msgpack.packb(r), budget_s))
            timings["bus_dec"].append(_time_per_call(lambda f=frame: decode(f), budget_s))
            timings["mp_dec"].append(_time_per_call(lambda f=raw_frame: msgpack.unpackb(f), budget_s))
            timings["mp_val_dec"].append(_time_per_call(lambda f=frame: hand_validated(f), budget_s))
        rows.append(
            {"payload": payload, "frame_bytes": len(frame)} | {k: statistics.median(v) for k, v in timings.items()}
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def _counts(payload: str, quick: bool) -> tuple[int, int, int]:
    """(throughput messages, latency messages, warm-up messages)."""
    full = {"1KB": (20_000, 2_000, 500), "100KB": (4_000, 1_000, 200), "4MB": (200, 60, 10)}
    small = {"1KB": (400, 50, 20), "100KB": (200, 30, 10), "4MB": (12, 4, 2)}
    return (small if quick else full)[payload]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    payloads = tuple(args.payloads.split(","))
    transports = tuple(args.transports.split(","))
    frame_bytes = {p: len(encode(make_message(p))) for p in payloads}
    samples: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    pair = Pair(use_uvloop=not args.no_uvloop)
    try:
        for repeat in range(args.repeats):
            order = ("raw", "bus") if repeat % 2 == 0 else ("bus", "raw")
            for payload in payloads:
                n, n_lat, warmup = _counts(payload, args.quick)
                for transport in transports:
                    for system in order:
                        entry = samples.setdefault(
                            (payload, transport, system), {"rate": [], "cpu": [], "p50": [], "p99": []}
                        )
                        result = pair.trial(system, transport, payload, "throughput", n, warmup, args.window)
                        entry["rate"].append(result["rate"])
                        entry["cpu"].append(result["cpu_us"])
                        lat = pair.trial(system, transport, payload, "latency", n_lat, warmup, 1)["latencies"]
                        entry["p50"].append(_percentile(lat, 0.50) * 1e6)
                        entry["p99"].append(_percentile(lat, 0.99) * 1e6)
    finally:
        pair.close()

    ray_status = "not installed"
    if ray_available() and not args.quick and not args.no_ray:
        ray_status = run_ray(payloads, args.repeats, samples, make_ray_payload, _percentile)
    elif ray_available():
        ray_status = "skipped (--quick or --no-ray)"

    rows = []
    for (payload, transport, system), entry in samples.items():
        rate = statistics.median(entry["rate"])
        rows.append(
            {
                "payload": payload,
                "transport": transport,
                "system": system,
                "frame_bytes": frame_bytes[payload],
                "msgs_per_s": rate,
                "mb_per_s": rate * frame_bytes[payload] / 1e6,
                "cpu_us_per_msg": statistics.median(entry["cpu"]) if entry["cpu"] else None,
                "p50_us": statistics.median(entry["p50"]),
                "p99_us": statistics.median(entry["p99"]),
            }
        )
    by_key = {(r["payload"], r["transport"], r["system"]): r for r in rows}
    for row in rows:
        raw = by_key.get((row["payload"], row["transport"], "raw"))
        ray_row = by_key.get((row["payload"], "ray", "ray"))
        row["vs_raw"] = row["msgs_per_s"] / raw["msgs_per_s"] if raw else None
        row["vs_ray"] = row["msgs_per_s"] / ray_row["msgs_per_s"] if ray_row and row["system"] == "bus" else None
    codec = codec_rows(payloads, budget_s=0.05 if args.quick else 0.3, repeats=1 if args.quick else 3)
    return {
        "config": {
            "repeats": args.repeats,
            "quick": args.quick,
            "event_loop": "asyncio" if args.no_uvloop else "uvloop",
            "window": args.window,
            "ray": ray_status,
        },
        "stream": sorted(rows, key=lambda r: (PAYLOADS.index(r["payload"]), r["transport"], r["system"])),
        "codec": codec,
        "targets": _targets(by_key),
    }


def _targets(by_key: dict[tuple[str, str, str], dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bus, raw = by_key.get(("100KB", "tcp", "bus")), by_key.get(("100KB", "tcp", "raw"))
    ray = by_key.get(("100KB", "ray", "ray"))
    if bus and raw:
        ratio = bus["msgs_per_s"] / raw["msgs_per_s"]
        out["bus_vs_raw_100KB_tcp"] = {"ratio": ratio, "target": 0.8, "met": ratio >= 0.8}
    if bus and ray:
        ratio = bus["msgs_per_s"] / ray["msgs_per_s"]
        out["bus_vs_ray_100KB"] = {"ratio": ratio, "target": 10.0, "met": ratio >= 10.0}
    return out


def render(result: dict[str, Any]) -> str:
    config = result["config"]
    lines = [
        f"bus stream (credit window {config['window']}) vs raw pyzmq+msgpack vs Ray; medians of "
        f"{config['repeats']} repeats; event loop {config['event_loop']}; Ray: {config['ray']}",
        "cpu = CPU microseconds per message of sender + receiver processes (all threads); latency: one in flight",
        "",
        f"{'payload':<8} {'transport':<9} {'system':<6} {'frame B':>9} {'msgs/s':>9} {'MB/s':>8} {'cpu us':>7} "
        f"{'p50 us':>8} {'p99 us':>8} {'vs raw':>7} {'vs Ray':>7}",
    ]
    for r in result["stream"]:
        vs_raw = f"{r['vs_raw']:.2f}" if r["vs_raw"] is not None else "-"
        vs_ray = f"{r['vs_ray']:.1f}x" if r["vs_ray"] is not None else "-"
        cpu = f"{r['cpu_us_per_msg']:.0f}" if r["cpu_us_per_msg"] is not None else "-"
        lines.append(
            f"{r['payload']:<8} {r['transport']:<9} {r['system']:<6} {r['frame_bytes']:>9} {r['msgs_per_s']:>9.0f} "
            f"{r['mb_per_s']:>8.1f} {cpu:>7} {r['p50_us']:>8.0f} {r['p99_us']:>8.0f} {vs_raw:>7} {vs_ray:>7}"
        )
    lines += [
        "",
        "codec, microseconds per message (median): bus = msgspec typed + validated; mp = msgpack-python;",
        "mp+validate = msgpack-python then msgspec.convert into the same structs (the alternative to msgspec decode)",
        f"{'payload':<8} {'frame B':>9} {'bus enc':>8} {'mp enc':>8} {'bus dec':>8} {'mp dec':>8} {'mp+validate':>12}",
    ]
    for r in result["codec"]:
        lines.append(
            f"{r['payload']:<8} {r['frame_bytes']:>9} {r['bus_enc']:>8.1f} {r['mp_enc']:>8.1f} {r['bus_dec']:>8.1f} "
            f"{r['mp_dec']:>8.1f} {r['mp_val_dec']:>12.1f}"
        )
    if result["targets"]:
        lines.append("")
        for name, target in result["targets"].items():
            verdict = "met" if target["met"] else "NOT met"
            lines.append(f"target {name}: {target['ratio']:.2f} (>= {target['target']}) {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few messages, one repeat, no Ray (smoke test)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per configuration (default 5; quick 1)")
    parser.add_argument("--payloads", default=",".join(PAYLOADS), help="comma-separated subset of 1KB,100KB,4MB")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated subset of tcp,ipc")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray even when installed")
    parser.add_argument("--no-uvloop", action="store_true", help="run the bus on the default asyncio loop")
    parser.add_argument("--window", type=int, default=16, help="the bus stream's credit window (default 16)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    for name in args.payloads.split(","):
        if name not in PAYLOADS:
            parser.error(f"--payloads: unknown payload {name!r}; choose from {', '.join(PAYLOADS)}")
    for name in args.transports.split(","):
        if name not in TRANSPORTS:
            parser.error(f"--transports: unknown transport {name!r}; choose from {', '.join(TRANSPORTS)}")
    result = run(args)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
