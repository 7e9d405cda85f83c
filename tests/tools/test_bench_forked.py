"""tools/bench/forked.py: a benchmark worker forked from its parent talks over its own stdin and stdout, and a
failing one leaves its traceback where the parent reads it back."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

from tools.bench.forked import ForkedWorker, forked_output


def echo_twice() -> None:
    for _ in range(2):
        line = sys.stdin.readline()
        print(f"echo {line.strip()}", flush=True)


def fail() -> None:
    raise ValueError("no such workload")


@pytest.mark.unit
def test_a_forked_worker_answers_on_its_own_pipes_and_exits_zero(tmp_path: Path) -> None:
    first, second = ForkedWorker(echo_twice, tmp_path / "first.err"), ForkedWorker(echo_twice, tmp_path / "2.err")
    for worker, word in ((second, "b"), (first, "a")):
        worker.stdin.write(f"{word}\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == f"echo {word}\n"
    for worker in (first, second):
        worker.stdin.write("done\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "echo done\n"
        assert worker.wait(timeout=30) == 0 and worker.poll() == 0


@pytest.mark.unit
def test_a_failing_worker_exits_one_with_its_traceback_in_its_errors_file(tmp_path: Path) -> None:
    worker = ForkedWorker(fail, tmp_path / "worker.err")
    assert worker.wait(timeout=30) == 1
    assert "ValueError: no such workload" in (tmp_path / "worker.err").read_text()


@pytest.mark.unit
def test_a_killed_worker_is_reaped(tmp_path: Path) -> None:
    worker = ForkedWorker(echo_twice, tmp_path / "worker.err")
    worker.kill()
    assert worker.poll() == -9


def print_a_figure() -> None:
    print('{"seconds": 1.5}')


@pytest.mark.unit
def test_forked_output_is_the_exit_code_and_all_the_worker_printed(tmp_path: Path) -> None:
    assert forked_output(print_a_figure, tmp_path / "figure.err") == (0, '{"seconds": 1.5}\n')
    assert forked_output(fail, tmp_path / "fail.err") == (1, "")
    assert "ValueError: no such workload" in (tmp_path / "fail.err").read_text()


class _Finalised:
    """Writes the pid of the process that finalises it into `record`."""

    def __init__(self, record: Path) -> None:
        self.record = record
        self.cycle = self

    def __del__(self) -> None:
        with self.record.open("a") as handle:
            handle.write(f"{os.getpid()}\n")


def collect_everything() -> None:
    gc.collect()
    print("collected", flush=True)


@pytest.mark.unit
def test_a_worker_never_finalises_the_garbage_its_parent_left(tmp_path: Path) -> None:
    record = tmp_path / "finalised"
    gc.disable()  # the cycle below stays uncollected garbage in this process until the fork
    try:
        _Finalised(record)
        assert forked_output(collect_everything, tmp_path / "worker.err") == (0, "collected\n")
        assert not record.exists()  # the worker's collection left it alone
    finally:
        gc.enable()
    gc.collect()
    assert record.read_text() == f"{os.getpid()}\n"  # the parent's garbage, finalised by the parent
