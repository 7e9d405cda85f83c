"""The Ray baseline of `tools/bench/bus_speed.py`: the same payloads sent from one Ray actor to another.

Apart so the bus benchmark reads without it, and so Ray (optional, heavy) is only imported when present.
At most `RAY_WINDOW` calls are in flight, the bus's default credit window, so both systems pipeline alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

RAY_WINDOW = 16
RAY_COUNTS = {"1KB": (1000, 200, 20), "100KB": (600, 100, 10), "4MB": (60, 20, 4)}  # throughput, latency, warm-up




def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


class RayBench:
    def __init__(self) -> None:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

        @ray.remote(num_cpus=0)
        class Receiver:
            def receive(self, payload: dict[str, Any]) -> float:
                return time.monotonic() - payload["t"]

        @ray.remote(num_cpus=0)
        class Sender:
            def throughput(self, receiver: Any, payload: dict[str, Any], n: int, warmup: int) -> float:
                ray.get([receiver.receive.remote(payload) for _ in range(warmup)])
                in_flight: list[Any] = []
                start = time.monotonic()
                for _ in range(n):
                    in_flight.append(receiver.receive.remote(payload))
                    if len(in_flight) >= RAY_WINDOW:
                        _, in_flight = ray.wait(in_flight, num_returns=1)
                ray.get(in_flight)
                return n / (time.monotonic() - start)

            def latency(self, receiver: Any, payload: dict[str, Any], n: int, warmup: int) -> list[float]:
                out = []
                for i in range(warmup + n):
                    payload["t"] = time.monotonic()
                    latency = ray.get(receiver.receive.remote(payload))
                    if i >= warmup:
                        out.append(latency)
                return out

        self.ray = ray
        self.receiver = Receiver.remote()
        self.sender = Sender.remote()

    def trial(self, data: dict[str, Any], mode: str, n: int, warmup: int) -> dict[str, Any]:
        call = self.sender.throughput if mode == "throughput" else self.sender.latency
        result = self.ray.get(call.remote(self.receiver, data, n, warmup))
        return {"rate": result} if mode == "throughput" else {"latencies": result}

    def close(self) -> None:
        self.ray.shutdown()


def run_ray(
    payloads: tuple[str, ...],
    repeats: int,
    samples: dict[tuple[str, str, str], dict[str, list[float]]],
    make_payload: Callable[[str], dict[str, Any]],
    percentile: Callable[[list[float], float], float],
) -> str:
    """Ray rows (fewer calls: Ray is two orders of magnitude slower); a Ray that cannot start is reported."""
    try:
        ray = RayBench()
    except Exception as exc:  # e.g. the raylet timing out on an overloaded machine
        return f"failed to start ({type(exc).__name__}: {str(exc)[:80]})"
    try:
        for _ in range(repeats):
            for payload in payloads:
                n, n_lat, warmup = RAY_COUNTS[payload]
                entry = samples.setdefault((payload, "ray", "ray"), {"rate": [], "cpu": [], "p50": [], "p99": []})
                entry["rate"].append(ray.trial(make_payload(payload), "throughput", n, warmup)["rate"])
                lat = ray.trial(make_payload(payload), "latency", n_lat, warmup)["latencies"]
                entry["p50"].append(percentile(lat, 0.50) * 1e6)
                entry["p99"].append(percentile(lat, 0.99) * 1e6)
    finally:
        ray.close()
    return "measured"
