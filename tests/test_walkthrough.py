"""docs/walkthrough.md against the code: its module counts are what its hops name, every function or class it places in
a file is defined there, and the defaults it follows (the demo's path on a CPU and on a GPU) are the run's defaults.
The page went stale once without anyone noticing (the weight check and the static KV engine landed after it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from actors.config import build_config
from actors.rollout.engine_factory import torch_kv_cache

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "walkthrough.md"
PRODUCT = ("actors/", "bus/", "engines/", "policies/")
COUNT = re.compile(r"— (\d+) (?:new )?modules?$")
NAMED_IN = re.compile(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?` \(`([\w/]+\.py)`")

pytestmark = pytest.mark.unit


def hops() -> list[tuple[str, list[str]]]:
    """(heading, paragraphs) of each section of the page."""
    sections = re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.M)[1:]
    return [(section.splitlines()[0], "\n".join(section.splitlines()[1:]).split("\n\n")) for section in sections]


def on_the_path(paragraph: str) -> bool:
    """A paragraph of the CPU demo's path: not a hop's helpers ("Deeper:") and not the GPU's difference."""
    return not paragraph.startswith(("Deeper:", "On a GPU"))


def test_each_hops_module_count_is_the_product_modules_it_names_first() -> None:
    """A module counts once, at the first hop that names it on the path; the total is the page's headline."""
    counted: set[str] = set()
    wrong = []
    for heading, paragraphs in hops():
        stated = COUNT.search(heading)
        if stated is None:
            continue
        named: list[str] = []
        for text in [heading, *filter(on_the_path, paragraphs)]:
            for path in re.findall(r"`([\w/]+\.py)`", text):
                if path.startswith(PRODUCT) and path not in counted and path not in named:
                    named.append(path)
        if int(stated[1]) != len(named):
            wrong.append(f"{heading}: says {stated[1]}, names {len(named)}: {named}")
        counted.update(named)
    assert not wrong, "\n".join(wrong)
    headline = re.search(r"\*\*(\d+) modules touch the sample\.\*\*", PAGE.read_text(encoding="utf-8"))
    assert headline and int(headline[1]) == len(counted), (headline, len(counted))


def defined_names(path: Path) -> set[str]:
    """Top-level and class-level functions, classes and assigned names of a module, and `Class.member` for members."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{member.name}")
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    names.add(f"{node.name}.{member.target.id}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def test_every_function_or_class_the_page_places_in_a_file_is_defined_there() -> None:
    text = " ".join(PAGE.read_text(encoding="utf-8").split())  # a name and its file may sit on two lines
    pairs = NAMED_IN.findall(text)
    assert len(pairs) >= 30, "the page's `name` (`file.py`) pairs were not found: has their form changed?"
    missing = [f"{name} in {path}" for name, path in pairs if name not in defined_names(ROOT / path)]
    assert not missing, f"named on the page but not defined in the file it names: {missing}"


def test_the_path_the_page_follows_is_the_default_one() -> None:
    """The settings the page's hops rest on, as a run without flags gets them."""
    config = build_config({})
    text = PAGE.read_text(encoding="utf-8")
    assert config.router.router_policy == "affinity" and "`--router-policy affinity`" in text
    assert config.weights.weight_check == "repush" and "`--weight-check repush`" in text
    assert config.engine.torch_kv_cache == "auto" and "`--torch-kv-cache auto`" in text
    assert config.weights.weight_check_stride == 16 and "one of 16 row slices" in text
    assert torch_kv_cache(config, torch.device("cpu")) == "dynamic"  # the page's hops: ContinuousBatcher, KVBatch
    assert torch_kv_cache(config, torch.device("cuda")) == "static"  # its "On a GPU" paragraph: StaticBatcher
