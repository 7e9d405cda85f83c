"""The README is where a newcomer starts: each page of docs/ is reachable from its table, and every page or file the
README and the docs name in backticks exists (a page that moved leaves no dead pointer behind)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# a repository path in backticks: a docs page, or a file of one of the top-level folders
NAMED_PATH = re.compile(r"`((?:docs|examples|tools|actors|engines|policies|bus|tests)/[\w./-]+\.(?:md|py|sh|png))`")


@pytest.mark.unit
def test_every_docs_page_is_in_the_readmes_index() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    index = readme[readme.index("## Where each topic lives"):]
    pages = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "docs").glob("*.md"))
    assert [page for page in pages if f"`{page}`" not in index] == []


@pytest.mark.unit
def test_every_path_the_readme_and_the_docs_name_exists() -> None:
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [f"{text.relative_to(REPO)}: {named}" for text in texts
               for named in NAMED_PATH.findall(text.read_text(encoding="utf-8")) if not (REPO / named).exists()]
    assert missing == []
