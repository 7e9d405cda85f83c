"""The GPU machine is offline: every dependency the project declares must be carried to it or be in its image."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


@pytest.mark.unit
def test_every_runtime_dependency_is_carried_or_in_the_gpu_image() -> None:
    declared = {_name(requirement) for requirement in tomllib.loads(
        (REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    listed: dict[str, set[str]] = {"carry": set(), "image": set()}
    for line in (REPO / "tools/gpu/wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            kind, requirement = line.split()
            assert kind in listed, line
            if kind == "carry":
                assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", requirement), f"pin {requirement!r}"
            listed[kind].add(_name(requirement))
    assert not listed["carry"] & listed["image"], "listed both carried and in the image"
    assert declared - listed["carry"] - listed["image"] == set()
