"""Read slime run scripts (bash arrays of flags) into the argv their `python3 train.py` line passes."""

from __future__ import annotations

import ast
import json
import operator
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "data" / "slime_scripts"
ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


def read_slime_script(path: Path, overrides: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(entry point, argv) of a slime run script: arrays `NAME=( ... )`, plain `VAR=value` and the final
    `python3 train.py ... ${NAME[@]}` command, expanded (`$(( ))` arithmetic and `$(seq ...)` too); `overrides`
    replaces variables (paths, sizes)."""
    variables: dict[str, str] = {}
    arrays: dict[str, list[str]] = {}
    lines = iter(path.read_text(encoding="utf-8").splitlines())
    entry, command = "", ""

    def expand(text: str) -> str:
        text = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m.group(1), m.group(0)), text)
        text = re.sub(r"\$\(\(([0-9+*/() -]+)\)\)", lambda m: str(_integer_arithmetic(m.group(1))), text)
        return re.sub(r"\$\(seq ([0-9 ]+)\)", lambda m: " ".join(map(str, _seq(m.group(1)))), text)

    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        match = ASSIGNMENT.match(stripped)
        if match and match.group(2) == "(":
            body = []
            for inner in lines:
                if inner.strip() == ")":
                    break
                body.append(inner)
            arrays[match.group(1)] = shlex.split(expand("\n".join(body)), comments=True)
        elif match:
            variables[match.group(1)] = (overrides or {}).get(match.group(1), " ".join(shlex.split(match.group(2))))
        elif re.match(r"python3? (train|train_async)\.py", stripped):
            entry = stripped.split()[1].removesuffix(".py")
            command = stripped
            while command.endswith("\\"):
                command = command[:-1] + " " + next(lines).strip()
    argv: list[str] = []
    for token in shlex.split(command)[2:]:
        array = re.fullmatch(r"\$\{([A-Z_][A-Z0-9_]*)\[@\]\}", token)
        argv.extend(arrays[array.group(1)] if array else [expand(token)])
    return entry, argv


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv}


def _integer_arithmetic(expression: str) -> int:
    """bash's `$(( ))` over integers (the scripts size buffers with it: `$((512 * 1024 * 1024))`)."""
    def value(node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"$(( {expression} )): only integers with + - * / are read")

    return value(ast.parse(expression.strip(), mode="eval").body)


def _seq(operands: str) -> range:
    """coreutils' `seq LAST`, `seq FIRST LAST` or `seq FIRST STEP LAST` (slime's CUDA-graph batch sizes)."""
    numbers = [int(n) for n in operands.split()]
    first, step, last = {1: (1, 1, numbers[0]), 2: (numbers[0], 1, numbers[-1]), 3: tuple(numbers)}[len(numbers)]
    return range(first, last + 1, step)


def run_slime_script(entry: str, argv: list[str], run_dir: Path, *, train_backend: str = "torch"
                     ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """A slime script's argv through `launcher.py --head --slime-entry ENTRY` on CPU (`--train-backend torch` unless
    told: slime's Megatron runs on megatron-core's CPU path here, slower to start), quiet; fails with the run's
    output unless it exits 0. Returns the finished process and the rows of its train.jsonl."""
    completed = subprocess.run(
        [sys.executable, str(REPO / "launcher.py"), "--head", "--slime-entry", entry, *argv,
         "--train-backend", train_backend, "--run-dir", str(run_dir), "--no-progress", "--no-use-tensorboard",
         "--no-plots", "--heartbeat-interval", "0.25"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = (run_dir / "metrics" / "train.jsonl").read_text().splitlines()
    return completed, [json.loads(line) for line in rows]
