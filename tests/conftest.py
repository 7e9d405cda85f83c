"""Shared fixtures: tiny models are built locally once per session (no downloads here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.tiny_model import TinyModelSpec, cached_tiny_model
from tests.support.summary import write_summaries


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
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
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen2"))
