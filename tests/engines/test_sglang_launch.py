"""Starting SGLang servers: the command line, attaching, failed starts."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from actors.config import split_sglang_args
from actors.rollout.engine_factory import attached_server_version, attached_url
from bus.address import free_port
from engines.sglang.launch import ServerProcess, ServerSpec, ServerStartError, probe, wait_for_attached_server


@pytest.mark.unit
def test_command_forwards_sglang_arguments_and_true_as_a_bare_switch() -> None:
    spec = ServerSpec(
        model_path="/m", tp_size=2, random_seed=5, extra={"mem-fraction-static": "0.7", "enable-metrics": "true"}
    )
    command = spec.command(port=31000)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    joined = " ".join(command[3:])
    assert "--model-path /m --host 127.0.0.1 --port 31000 --tp-size 2 --random-seed 5" in joined
    assert joined.endswith("--mem-fraction-static 0.7 --enable-metrics")


@pytest.mark.unit
def test_a_list_valued_sglang_argument_reaches_the_server_one_token_per_value() -> None:
    rest, extra = split_sglang_args(["--sglang-cuda-graph-bs", "1", "2", "4", "--sglang-json-model-override-args",
                                     '{"rope_scaling": {"factor": 2}}', "--lr", "0.1"])
    assert rest == ["--lr", "0.1"]
    command = ServerSpec(model_path="/m", extra=extra).command(port=1)
    at = command.index("--cuda-graph-bs")
    assert command[at + 1: at + 4] == ["1", "2", "4"]
    assert command[command.index("--json-model-override-args") + 1] == '{"rope_scaling": {"factor": 2}}'


@pytest.mark.unit
def test_attached_worker_takes_the_url_at_its_index_and_too_few_urls_is_an_error() -> None:
    urls = ["http://a:1", "http://b:2"]
    assert attached_url(urls, "rollout-0-1") == "http://b:2"
    with pytest.raises(ValueError, match="too few for rollout worker rollout-0-2"):
        attached_url(urls, "rollout-0-2")
    with pytest.raises(ValueError, match="id is unknown"):
        attached_url(urls, None)


@pytest.mark.integration
def test_server_that_exits_during_start_up_fails_with_its_log(tmp_path: Path) -> None:
    process = ServerProcess(
        ServerSpec(model_path=str(tmp_path), module="no_such_sglang_module"), startup_timeout=30, log_dir=tmp_path
    )
    with pytest.raises(ServerStartError, match=r"exited with code 1 during start-up(?s:.)*no_such_sglang_module"):
        process.start()
    assert not process.alive()


@pytest.mark.unit
def test_base_gpu_id_is_passed_as_sglangs_flag_and_must_not_be_negative() -> None:
    assert "--base-gpu-id 3" in " ".join(ServerSpec(model_path="/m", base_gpu_id=3).command(port=1))
    assert "--base-gpu-id" not in ServerSpec(model_path="/m").command(port=1)
    with pytest.raises(ValueError, match="base_gpu_id"):
        ServerSpec(model_path="/m", base_gpu_id=-1)


@pytest.mark.integration
def test_an_attached_server_still_loading_is_awaited_and_one_that_never_answers_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rollout worker attached to a server that is not up yet waits for its health (the launcher used to restart
    the worker at each refused call while the server loaded) and, past the deadline, fails naming it."""
    import http.server
    import logging

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            known = self.path in ("/health", "/health_generate", "/model_info")
            self.send_response(200 if known else 404)
            self.end_headers()
            if self.path == "/model_info":
                self.wfile.write(b'{"weight_version": "7"}')

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ConnectionError, match=rf"--sglang-url {url}: not healthy after 0.3s"):
        wait_for_attached_server(url, timeout_s=0.3)
    caplog.set_level(logging.INFO, logger="engines.sglang.launch")
    caplog.clear()
    outcome: list[object] = []

    def attach() -> None:  # the rollout worker's engine factory, reading the version the server serves
        try:
            outcome.append(attached_server_version(url, timeout=60))
        except BaseException as error:
            outcome.append(error)

    waiter = threading.Thread(target=attach)
    waiter.start()
    deadline = time.monotonic() + 30
    while not any("waiting for the attached SGLang server" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the worker never began to wait for the server"
        time.sleep(0.02)
    server = http.server.HTTPServer(("127.0.0.1", port), Healthy)  # the server comes up while the worker waits
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        waiter.join(30)
        assert not waiter.is_alive() and outcome == [7]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
def test_a_server_started_from_a_thread_that_exits_keeps_running_and_one_whose_port_is_taken_starts_again(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Two claims on one start (each costs a model load). The parent-death signal follows the forking THREAD; a
    restart runs in a short-lived executor thread, so the start here runs in one that exits. The port is free when
    chosen and taken when the server binds it: the first start dies of it, the second, on a port chosen again,
    serves."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    process = ServerProcess(
        ServerSpec(model_path=str(tiny_model_path), module="tools.standins.sglang_server",
                   extra={"torch-threads": "1"}),
        startup_timeout=120, log_dir=tmp_path, choose_port=lambda host: next(ports, None) or free_port(host))
    started: list[str] = []
    starter = threading.Thread(target=lambda: started.append(process.start()))
    starter.start()
    starter.join()
    try:
        assert started, process.log_tail()
        time.sleep(1.0)
        assert process.alive(), process.log_tail()
        assert process.starts == 2
        assert process.port != taken.getsockname()[1]
        assert probe(started[0] + "/health", timeout=5.0)
    finally:
        process.stop()
        taken.close()


@pytest.mark.integration
def test_a_server_given_a_taken_port_by_name_fails_with_its_log(tiny_model_path: Path, tmp_path: Path) -> None:
    """A port the user named is theirs to fix: no second start on another one."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    process = ServerProcess(
        ServerSpec(model_path=str(tiny_model_path), module="tools.standins.sglang_server",
                   port=taken.getsockname()[1], extra={"torch-threads": "1"}),
        startup_timeout=120, log_dir=tmp_path)
    try:
        with pytest.raises(ServerStartError, match=r"(?i)address already in use"):
            process.start()
        assert process.starts == 1
    finally:
        process.stop()
        taken.close()
