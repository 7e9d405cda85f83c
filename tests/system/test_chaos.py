"""The chaos matrix's CI subset (issue #17): real runs under kill -9 at chosen phases and a faulty bus, audited.

The bounded quick version of `tools/chaos/matrix.py`: the learner killed between broadcasting a weight update and
collecting its acknowledgements, on a bus that drops, duplicates and delays messages everywhere; the buffer
killed after logging a served batch and before replying, and the reward worker holding a scored group. Each run
must complete with every step trained, every fault must really have happened, and the audit must find nothing
lost, nothing trained twice and versions monotone. The table is printed in the run's closing summary and is the
assertion's message.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.summary import add_summary
from tools.chaos.matrix import format_table, run_matrix
from tools.chaos.scenarios import ci_matrix
from tools.make_arithmetic_data import make_arithmetic_data


@pytest.mark.system
@pytest.mark.timeout(420)
def test_the_ci_chaos_matrix_loses_nothing_and_trains_nothing_twice(tmp_path: Path, tiny_model_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    task = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    rows = run_matrix(ci_matrix(), work_dir=tmp_path, model=tiny_model_path, data=task)
    table = format_table(rows)
    add_summary(request.config, "chaos matrix, CI subset (tools/chaos/matrix.py)", table)  # for the CI log
    assert [row.verdict for row in rows] == ["PASS"] * len(rows), table
    assert all(row.injected and row.injected != "nothing fired" for row in rows), table
