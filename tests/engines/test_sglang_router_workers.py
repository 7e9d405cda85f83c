"""Reading the SGLang servers behind an sglang-router (`engines/sglang/router_workers.py`) from the stand-in router
over real HTTP: the servers registered with it, and the deadline and errors when it gives none."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Iterator

import pytest
import requests

from engines.sglang.router_workers import RouterWorkersError, router_servers
from tests.support.waiting import until_sync
from tools.standins.sglang_router import RouterStandIn

pytestmark = pytest.mark.integration
Router = tuple[RouterStandIn, str]


def test_the_servers_are_those_registered_with_the_router_in_url_order(sglang_router: Router) -> None:
    stand_in, url = sglang_router
    stand_in.register("http://10.0.0.2:30000/")
    for server in ("http://10.0.0.1:30001", "http://10.0.0.1:30000"):  # as slime's engines register
        assert requests.post(url + "/workers", json={"url": server, "worker_type": "regular"},
                             timeout=10).status_code == 202
    servers = router_servers(url, timeout=5)
    assert servers.urls == ["http://10.0.0.1:30000", "http://10.0.0.1:30001", "http://10.0.0.2:30000"]
    assert servers.unhealthy == []


def test_a_worker_the_router_marks_unhealthy_is_left_out(sglang_router: Router) -> None:
    stand_in, url = sglang_router
    stand_in.register("http://10.0.0.1:30000")
    stand_in.register("http://10.0.0.1:30001")["is_healthy"] = False
    servers = router_servers(url, timeout=5)
    assert servers.urls == ["http://10.0.0.1:30000"] and servers.unhealthy == ["http://10.0.0.1:30001"]


def test_servers_that_register_within_the_deadline_are_found(sglang_router: Router) -> None:
    stand_in, url = sglang_router
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(router_servers, url, timeout=20)
        until_sync(lambda: stand_in.asked >= 2, "the router asked again after an empty list")
        stand_in.register("http://10.0.0.1:30000")
        assert asked.result(timeout=20).urls == ["http://10.0.0.1:30000"]


def test_a_router_that_lists_no_workers_is_an_error_naming_it_at_the_deadline(sglang_router: Router) -> None:
    stand_in, url = sglang_router
    started = time.monotonic()
    with pytest.raises(RouterWorkersError, match=rf"sglang-router {url}: .* within 1s: it lists no workers"):
        router_servers(url, timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 5
    assert stand_in.asked >= 2


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a router hung, or another service)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def test_a_router_that_does_not_answer_is_an_error_naming_it_at_the_deadline(silent_port: int) -> None:
    url = f"http://127.0.0.1:{silent_port}"
    started = time.monotonic()
    with pytest.raises(RouterWorkersError, match=rf"sglang-router {url}: .* within 1.5s: no answer"):
        router_servers(url, timeout=1.5, attempt_s=0.5)
    assert time.monotonic() - started < 5


def test_nothing_listening_is_an_error_naming_the_router() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(RouterWorkersError, match=rf"sglang-router {url}: .* no answer .*refused"):
            router_servers(url, timeout=0.5)


def test_an_address_that_is_not_a_router_fails_at_once(sglang_router: Router) -> None:
    _, url = sglang_router
    started = time.monotonic()
    with pytest.raises(RouterWorkersError, match=r"/not-a-router: GET /workers answered 404"):
        router_servers(url + "/not-a-router", timeout=30)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(("field", "value", "error"), [
    ("worker_type", "prefill", "is a prefill worker; prefill/decode disaggregation is not available"),
    ("connection_mode", "Grpc", "is reached over Grpc; the SGLang client here speaks the servers' HTTP API"),
    ("url", "grpc://10.0.0.1:30000", "worker 0 has no HTTP url"),
])
def test_a_worker_we_cannot_drive_is_refused_by_name(sglang_router: Router, field: str, value: str,
                                                      error: str) -> None:
    stand_in, url = sglang_router
    stand_in.register("http://10.0.0.1:30000")[field] = value
    with pytest.raises(RouterWorkersError, match=error):
        router_servers(url, timeout=30)
