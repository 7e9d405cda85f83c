"""Fixtures the engine tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.http_apps import served
from tools.standins.sglang_router import RouterStandIn


@pytest.fixture
def megatron_world() -> Iterator[None]:
    """A one-rank Megatron world on this machine's device (gloo on CPU), torn down after the test."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    from engines.megatron import parallel
    from engines.megatron.cpu_compat import maybe_cpu_compat

    owns = parallel.ensure_default_group(parallel.compute_device())
    with maybe_cpu_compat():
        parallel.initialize_model_parallel(1, 1, seed=0)
    try:
        yield
    finally:
        parallel.destroy_model_parallel()
        if owns:
            torch.distributed.destroy_process_group()


@pytest.fixture
def sglang_router() -> Iterator[tuple[RouterStandIn, str]]:
    """The stand-in sglang-router (no workers yet) on a port of its own, served from its own event loop thread."""
    router = RouterStandIn()
    with served(router.app()) as url:
        yield router, url
