"""The SGLang servers an sglang-router has registered, read from its worker list: how a run attaches to the servers
behind a router a slime user already runs (slime's `--sglang-router-ip/--sglang-router-port`, our
`--sglang-router-url`).

The router is asked once, at start-up, and then left out of the way: every rollout worker attaches to one of its
servers as with `--sglang-url`, so the learner pushes weights to each server and every token is tagged with its
server's weight version; our own router policy spreads the calls over the servers (`docs/router.md`).

The contract is sglang-router's documented API for its 0.3 releases (`SUPPORTED_SGLANG_ROUTER`, slime pins 0.3.2):
`GET /workers` answers `{"workers": [{"id", "url", "worker_type", "connection_mode", "is_healthy", ...}], "total",
"stats"}`. `tests/engines/test_sglang_router_contract.py` checks it against each release's own documentation. A
worker of another kind than an HTTP server of the regular type (prefill/decode disaggregation, a gRPC worker) is
refused by name, since our client speaks SGLang's HTTP API to whole servers; one the router marks unhealthy is left
out. Blocking on purpose (urllib): the launcher asks before any event loop runs.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORKERS_PATH = "/workers"
SUPPORTED_SGLANG_ROUTER: tuple[str, ...] = ("0.3.0", "0.3.2")
READ_FIELDS = ("url", "worker_type", "connection_mode", "is_healthy")  # what we read of each listed worker
ATTEMPT_S = 2.0


class RouterWorkersError(RuntimeError):
    """The router did not give servers to attach to; the message names its URL and why."""


@dataclass(frozen=True)
class RouterServers:
    """The servers to attach to, and the workers left out because the router marks them unhealthy."""

    urls: list[str]
    unhealthy: list[str]


def router_servers(router_url: str, *, timeout: float, attempt_s: float = ATTEMPT_S,
                   clock: Callable[[], float] = time.monotonic) -> RouterServers:
    """The HTTP servers `router_url` lists, asked until it lists at least one or `timeout` seconds passed.

    A router that is still starting, or whose servers are still registering, gets the whole `timeout`; an answer
    that is not sglang-router's worker list, or that lists a worker we cannot drive, fails at once."""
    base = router_url.rstrip("/")
    deadline = clock() + timeout
    last = "no answer"
    while True:
        remaining = deadline - clock()
        try:
            body = _get_json(base + WORKERS_PATH, timeout=max(0.05, min(attempt_s, remaining)))
        except urllib.error.HTTPError as error:
            if error.code < 500:  # not a router's worker list (another service, an API key it wants): ask no more
                raise RouterWorkersError(f"sglang-router {router_url}: GET {WORKERS_PATH} answered {error.code} "
                                         f"{error.reason}") from None
            last = f"GET {WORKERS_PATH} answered {error.code} {error.reason}"
        except OSError as error:  # refused, reset, timed out (URLError is one)
            last = f"no answer ({getattr(error, 'reason', None) or error})"
        else:
            servers = parse_workers(router_url, body)
            if servers.urls:
                return servers
            last = ("it lists no workers" if not servers.unhealthy else
                    f"it lists only unhealthy workers ({', '.join(servers.unhealthy)})")
        if clock() >= deadline:
            raise RouterWorkersError(
                f"sglang-router {router_url}: no SGLang server to attach to within {timeout:g}s: {last} (the run "
                "attaches to the servers registered with the router; register them first, or give them with "
                "--sglang-url)")
        time.sleep(min(0.2, max(0.0, deadline - clock())))


def parse_workers(router_url: str, body: Any) -> RouterServers:
    """The server URLs of a `GET /workers` answer, sorted (the router's order is its registry's, not stable)."""
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list):
        raise RouterWorkersError(f"sglang-router {router_url}: GET {WORKERS_PATH} answered {_short(body)}, not "
                                 "sglang-router's worker list ({\"workers\": [{\"url\": ...}, ...]})")
    urls: set[str] = set()
    unhealthy: list[str] = []
    for index, worker in enumerate(workers):
        url = worker.get("url") if isinstance(worker, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RouterWorkersError(f"sglang-router {router_url}: GET {WORKERS_PATH} worker {index} has no HTTP "
                                     f"url: {_short(worker)}")
        kind = worker.get("worker_type", "regular")
        if kind != "regular":
            raise RouterWorkersError(f"sglang-router {router_url}: worker {url} is a {kind} worker; prefill/decode "
                                     "disaggregation is not available here (attach to regular SGLang servers)")
        mode = str(worker.get("connection_mode", "Http"))
        if mode.lower() != "http":
            raise RouterWorkersError(f"sglang-router {router_url}: worker {url} is reached over {mode}; the SGLang "
                                     "client here speaks the servers' HTTP API")
        if worker.get("is_healthy", True) is False:
            unhealthy.append(url)
        else:
            urls.add(url.rstrip("/"))
    return RouterServers(sorted(urls), unhealthy)


def _get_json(url: str, *, timeout: float) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."
