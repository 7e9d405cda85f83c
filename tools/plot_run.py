"""Pictures and a summary of a run directory: `python -m tools.plot_run RUN_DIR`.

The launcher writes the same at the end of every run (`actors.report.run_report`); this redraws them, e.g. for a
run that was killed before its end or one copied from another machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from actors.report.run_report import plot_run, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    for path in plot_run(args.run_dir):
        print(f"wrote {path}")
    print(summarize(args.run_dir))


if __name__ == "__main__":
    main()
