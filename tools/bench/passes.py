"""The `main` of a benchmark whose timed passes each run in a process of their own (tools/bench/engine.py says why):
the same command line runs the whole benchmark, or, with `--pass`, one pass in a child."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any


def run_benchmark(args: argparse.Namespace, *, run_pass: Callable[[argparse.Namespace], None],
                  benchmark: Callable[[argparse.Namespace], Any], print_table: Callable[[Any], None]) -> int:
    """A child (`args.pass_` set) runs its pass and prints what it measured; the parent runs the benchmark, prints
    its table and writes its figures (a dataclass) to `args.json` if given."""
    import torch

    from actors.runtime.logs import quiet_library_output

    quiet_library_output()  # transformers' load and save bars otherwise interleave with the table
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.pass_ is not None:
        run_pass(args)
        return 0
    figures = benchmark(args)
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(asdict(figures), indent=2))
    return 0
