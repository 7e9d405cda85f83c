"""docs/policies.md lists every built-in of each registry: a reward registered without a row (final_number and three
more went unlisted) fails here, not in a user's hunt through the source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from policies.registry import ADVANTAGE_ESTIMATORS, CORRECTIONS, FILTERS, KL_ESTIMATORS, POLICY_LOSSES, REWARDS
from policies.rewards.selection import REMOTE_RM_TYPE

DOC = (Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text(encoding="utf-8")


def _section(heading: str) -> str:
    """The text under a `## heading` up to the next one."""
    start = DOC.index(f"\n## {heading}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


def _first_column(section: str, header: str) -> set[str]:
    """The `names` in the first cells of the table whose header row starts with `header`."""
    rows = []
    for line in section[section.index(f"| {header} |"):].splitlines()[2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        rows.append(line)
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


@pytest.mark.unit
@pytest.mark.parametrize(("heading", "header", "names"), [
    ("Rewards", "`--rm-type`", lambda: [*REWARDS.names(), REMOTE_RM_TYPE]),
    ("Advantages and returns", "estimator", ADVANTAGE_ESTIMATORS.names),
    ("KL", "name", KL_ESTIMATORS.names),
    ("Off-policy corrections", "name", CORRECTIONS.names),
])
def test_every_built_in_has_a_row_in_its_table(heading: str, header: str, names) -> None:
    listed = _first_column(_section(heading), header)
    assert set(names()) - listed == set()


@pytest.mark.unit
@pytest.mark.parametrize(("heading", "pattern", "names"), [
    ("Losses", "**`{}`**", POLICY_LOSSES.names),
    ("Sample filters", "- `{}`:", FILTERS.names),
])
def test_every_built_in_has_an_entry_in_its_list(heading: str, pattern: str, names) -> None:
    section = _section(heading)
    assert [name for name in names() if pattern.format(name) not in section] == []
