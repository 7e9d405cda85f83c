"""The chaos matrix (issue #17): real small runs under faults, each judged by its outcome and by the audit.

    python -m tools.chaos.matrix --quick                    # a bounded subset: a few minutes on two cores
    python -m tools.chaos.matrix                            # every scenario (tools/chaos/scenarios.py)
    python -m tools.chaos.matrix --only kill-learner-mid-weight-push bus-mixed --keep-runs runs/chaos --json chaos.json

Each scenario is one real run through launcher.py (fully async unless it says otherwise) with its fault: kill -9
of a role at a chosen phase (actors/runtime/chaos.py; or a stall of a few seconds there) or at a random moment,
SIGSTOP of an actor past its heartbeat deadline and SIGCONT later, SIGSTOP of a singleton left stopped, or a bus
that drops, duplicates and delays messages (bus/faults.py). A row
passes when the run ended as expected within its deadline ("completes": exit 0 and every step trained; "fails":
exit 1 within --hang-timeout + 30 s, naming the stopped actor), the fault really happened (the kill point fired,
the bus injected, the stopped actor was declared dead), and tools/audit_run.py finds no accepted sample lost, none
trained twice, and versions monotone. The table says what each fault did, in counts; exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tools.chaos.run import Outcome, run_scenario
from tools.chaos.scenarios import MATRICES, Scenario

COLUMNS = ("scenario", "fault", "expected", "outcome", "wall s", "steps", "acc/trn/pend grp", "retrained",
           "faults injected", "verdict", "reason")


def run_matrix(scenarios: Sequence[Scenario], *, work_dir: Path, model: Path | None = None, data: Path | None = None,
               keep_runs: Path | None = None, on_row: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run each scenario in turn (runs share the machine, never each other's time) and return its row.

    `model` and `data` default to the tiny test model and the arithmetic task, built once under `work_dir`. Run
    directories go under `keep_runs` when given, else under `work_dir` (deleted once judged, unless they FAIL).
    """
    model = model or tiny_model(work_dir)
    data = data or arithmetic_task(work_dir)
    rows = []
    for scenario in scenarios:
        runs = keep_runs or work_dir / "runs"
        run_dir = runs / f"{scenario.name}-{time.strftime('%H%M%S')}"
        row = run_scenario(scenario, model=model, data=data, run_dir=run_dir)
        if keep_runs is None and row.verdict == "PASS":
            shutil.rmtree(run_dir, ignore_errors=True)
            row.run_dir = ""
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def tiny_model(work_dir: Path) -> Path:
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()  # before transformers loads: no progress bars in the matrix's table
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    return cached_tiny_model(work_dir / "models", TinyModelSpec(family="qwen2"))


def arithmetic_task(work_dir: Path) -> Path:
    from tools.make_arithmetic_data import make_arithmetic_data

    return make_arithmetic_data(work_dir / "data", max_operand=9, eval_size=10)["train"]


# ------------------------------------------------------------------------------------------------- table
def cells(row: Outcome) -> list[str]:
    return [row.scenario, row.fault, row.expected, row.outcome, f"{row.wall_s:.0f}",
            f"{row.steps}/{row.num_rollout}", f"{row.accepted_groups}/{row.trained_groups}/{row.pending_groups}",
            str(row.retrained_batches), row.injected, row.verdict, row.reason]


def format_table(rows: Sequence[Outcome]) -> str:
    """One plain-text table, a row per scenario, then the tally."""
    body = [list(COLUMNS), *(cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join(value.ljust(width) for value, width in zip(line, widths, strict=False)) + "  " + line[-1]
             for line in body]
    tally = {verdict: sum(row.verdict == verdict for row in rows) for verdict in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{len(rows)} scenarios: {tally['PASS']} passed, {tally['FAIL']} failed, {tally['SKIP']} skipped")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- CLI
def choose(args: argparse.Namespace) -> list[Scenario]:
    scenarios = MATRICES["quick" if args.quick else args.matrix]()
    if args.only:
        known = {s.name: s for matrix in MATRICES.values() for s in matrix()}
        unknown = [name for name in args.only if name not in known]
        if unknown:
            raise SystemExit(f"chaos: unknown scenario(s) {unknown}; known: {', '.join(sorted(known))}")
        scenarios = [known[name] for name in args.only]
    return scenarios


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the bounded subset (same as --matrix quick)")
    parser.add_argument("--matrix", choices=sorted(MATRICES), default="full", help="which scenarios")
    parser.add_argument("--only", nargs="+", default=None, metavar="SCENARIO", help="just these scenarios, by name")
    parser.add_argument("--list", action="store_true", help="list the chosen scenarios and exit")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this path")
    parser.add_argument("--keep-runs", type=Path, default=None, help="keep every run directory under this path")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the tiny model, the data and unkept runs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    scenarios = choose(args)
    if args.list:
        for scenario in scenarios:
            print(f"{scenario.name:40s} {scenario.expect:10s} {scenario.fault}")
        return 0
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="slipstream-chaos-"))
    print(f"chaos matrix: {len(scenarios)} scenario(s); work dir {work_dir}", file=sys.stderr)

    def progress(row: Outcome) -> None:
        print(f"  {row.scenario}: {row.verdict} ({row.outcome}, {row.wall_s:.0f}s) {row.reason}", file=sys.stderr)

    rows = run_matrix(scenarios, work_dir=work_dir, keep_runs=args.keep_runs, on_row=progress)
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([row.to_json() for row in rows], indent=2), encoding="utf-8")
    return 1 if any(row.verdict == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
