"""Figures a passing test wants in the CI log (the chaos table, the hostile-input counts): pytest captures a passing
test's output, so they are collected here and printed in the run's closing summary (tests/conftest.py)."""

from __future__ import annotations

import pytest

SECTIONS = pytest.StashKey[list[tuple[str, str]]]()


def add_summary(config: pytest.Config, title: str, text: str) -> None:
    config.stash.setdefault(SECTIONS, []).append((title, text))


def write_summaries(reporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    for title, text in config.stash.get(SECTIONS, []):
        reporter.write_sep("-", title)
        reporter.write_line(text)
