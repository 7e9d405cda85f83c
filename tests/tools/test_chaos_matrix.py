"""The chaos matrix without running anything: every scenario of every matrix is well-formed, and the CLI says so."""

from __future__ import annotations

import pytest

from actors.runtime import chaos
from bus.faults import FaultPlan
from tools.chaos.matrix import format_table, main
from tools.chaos.run import Outcome, launcher_accepts
from tools.chaos.scenarios import MATRICES

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("matrix", sorted(MATRICES))
def test_every_scenario_has_a_usable_fault(matrix: str) -> None:
    scenarios = MATRICES[matrix]()
    assert len({s.name for s in scenarios}) == len(scenarios), "scenario names must be unique"
    for scenario in scenarios:
        if scenario.kill_plan:
            assert chaos.parse_plan(scenario.kill_plan)
        if scenario.bus_plan:
            FaultPlan.parse(scenario.bus_plan)
        if scenario.how in ("kill", "stop", "stop_left"):
            assert scenario.target and scenario.after_step < scenario.num_rollout
        if scenario.how == "none":
            assert scenario.name == "baseline"
        assert (scenario.expect == "fails") == (scenario.how == "stop_left"), scenario.name
        assert scenario.expect == "completes" or scenario.hang_timeout, "a run expected to fail needs a hang timeout"


def test_the_ci_matrix_is_a_few_bounded_runs() -> None:
    ci = MATRICES["ci"]()
    assert len(ci) <= 3 and all(s.deadline_s <= 90 for s in ci)
    assert {s.name for s in ci} <= {s.name for s in MATRICES["full"]()}


def test_the_launcher_flags_a_scenario_needs_are_known() -> None:
    assert launcher_accepts("--max-staleness") and not launcher_accepts("--no-such-flag")


def test_list_names_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(s.name in listed for s in MATRICES["quick"]())


def test_an_unknown_scenario_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit, match=r"unknown scenario.*'no-such'.*baseline"):
        main(["--only", "no-such", "--list"])


def test_the_table_has_a_row_per_scenario_and_a_tally() -> None:
    rows = [Outcome("a", "bus drop=1", "completes", outcome="completed", verdict="PASS", reason="ok", injected="x"),
            Outcome("b", "kill -9", "completes", outcome="timed out", verdict="FAIL", reason="no exit")]
    table = format_table(rows).splitlines()
    assert table[0].startswith("scenario") and table[0].rstrip().endswith("reason")
    assert table[1].startswith("a ") and table[2].rstrip().endswith("no exit")
    assert table[-1] == "2 scenarios: 1 passed, 1 failed, 0 skipped"
