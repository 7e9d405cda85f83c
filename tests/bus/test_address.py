"""Bind addresses: port 0 reports the real port, ipc paths are checked, wildcards become reachable hosts."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from bus.address import bind, bind_address, connectable, ephemeral_port_range, free_port, ipc_sockets_dir


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path: pytest's own temp paths (deeper under pytest-xdist) leave too few of the 107
    bytes for the "sockets stay in the run directory" case."""
    with tempfile.TemporaryDirectory(prefix="addr-") as folder:
        yield Path(folder)


@pytest.mark.unit
def test_binding_port_zero_reports_the_port_the_os_chose() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = bind(sock, bind_address("127.0.0.1"))
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    other = ctx.socket(zmq.DEALER)
    other.connect(endpoint)  # the reported endpoint is connectable
    ctx.destroy(linger=0)


@pytest.mark.unit
def test_a_free_port_is_bindable_and_below_the_ports_outgoing_connections_are_given() -> None:
    """Its callers bind it later, in another process: an ephemeral port could be taken meanwhile by any outgoing
    connection on the node (seen taking a learner's rank store port and a controller's head port)."""
    import socket

    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < ephemeral_port_range()[0] for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.unit
def test_ipc_address_lives_in_the_run_directory(tmp_path: Path) -> None:
    run_dir = Path("/tmp") / f"bus-addr-{tmp_path.name[-6:]}"
    assert bind_address(transport="ipc", run_dir=run_dir, name="inbox") == f"ipc://{run_dir}/inbox.sock"
    assert run_dir.is_dir()
    run_dir.rmdir()


@pytest.mark.unit
def test_ipc_path_over_the_os_limit_is_refused_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the OS limit is 107"):
        bind_address(transport="ipc", run_dir=tmp_path / ("d" * 120))


@pytest.mark.unit
def test_bad_transport_and_bad_bind_address_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="transport must be 'tcp' or 'ipc'"):
        bind_address(transport="udp")  # type: ignore[arg-type]
    ctx = zmq.Context()
    with pytest.raises(ValueError, match=r"expected tcp://HOST:PORT"):
        bind(ctx.socket(zmq.ROUTER), "127.0.0.1:5555")
    ctx.destroy(linger=0)


@pytest.mark.unit
def test_wildcard_binds_are_advertised_under_a_concrete_host() -> None:
    advertised = connectable("tcp://0.0.0.0:5555")
    assert advertised.endswith(":5555") and "0.0.0.0" not in advertised
    assert connectable("ipc:///tmp/x.sock") == "ipc:///tmp/x.sock"


@pytest.mark.unit
def test_an_actor_binds_by_the_bus_rule_ipv6_host_and_ipc_limit_included(short_dir: Path) -> None:
    from actors.runtime.context import ActorContext  # the one caller outside bus/ that names its own endpoints

    tmp_path = short_dir

    def context(**overrides: object) -> ActorContext:
        return ActorContext(actor_id="rollout-0", role="rollout", actor_class="x:Y", node_rank=0,
                            head_address="tcp://127.0.0.1:1", run_dir=tmp_path, **overrides)  # type: ignore[arg-type]

    ctx = zmq.Context()
    try:
        endpoint = bind(ctx.socket(zmq.ROUTER), context(host="::1").bind_address("rpc"))
    finally:
        ctx.destroy(linger=0)
    assert endpoint.startswith("tcp://[::1]:")
    assert context(transport="ipc").bind_address("inbox") == f"ipc://{tmp_path}/sockets/rollout-0-inbox.sock"
    with pytest.raises(ValueError, match="the OS limit is 107"):  # a deep run_dir moves the folder; a name cannot
        ActorContext(actor_id="r" * 120, role="rollout", actor_class="x:Y", node_rank=0, head_address="tcp://h:1",
                     run_dir=tmp_path, transport="ipc").bind_address("inbox")


@pytest.mark.unit
def test_a_deep_run_directory_keeps_its_ipc_sockets_in_a_short_folder_of_its_own(short_dir: Path) -> None:
    """A deep run directory used to fail every actor's ipc bind (the OS allows 107 bytes), a crash loop."""
    tmp_path = short_dir
    shallow = tmp_path / "run"
    assert ipc_sockets_dir(shallow) == shallow / "sockets"
    deep = tmp_path / ("d" * 60) / "run"
    folder = ipc_sockets_dir(deep)
    assert folder != ipc_sockets_dir(tmp_path / ("e" * 60) / "run") and folder == ipc_sockets_dir(deep)
    address = bind_address(transport="ipc", run_dir=folder, name="custom-actor-with-a-long-name-0-12-inbox")
    context = zmq.Context.instance()
    sock = context.socket(zmq.PULL)
    try:
        assert bind(sock, address).startswith("ipc://")
    finally:
        sock.close(linger=0)
