"""The `python3 train.py ...` command line a slime run script would start, found by running the script under bash
with nothing real to start.

A run script is bash (arrays, `source scripts/models/X.sh`, `$(seq ...)`, `$(( ))`, heredocs, `if` on detected
GPUs); reading it as bash would is the only faithful reading, so bash runs it, in a sandbox where nothing it means
to start can start: PATH holds only a few read-only text tools (dirname, wc, tr, seq, ...) and a `mktemp` that
answers a path inside the sandbox. Every other command (`python3`, `ray`, `pkill`, `sleep`, `nvidia-smi`, `ssh`,
`rm`, `mkdir`, `pip` ...) is found by no PATH lookup, so bash calls `command_not_found_handle`, which the sandbox
defines to record the command's argv and succeed. `ray job submit ... -- python3 train.py ARGS` is one such record;
its ARGS are the script's command line. A script that names an absolute program (`/usr/bin/python3`) is refused
before it runs.

The model-flag file a script sources is recorded too: each `scripts/models/*.sh` of the sandbox's copy of the
checkout starts with a line that records its own name, which says which model family the script trains.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ENTRY_SCRIPTS = ("train.py", "train_async.py")
# Real programs the scripts compute values with; none writes a file or starts a process.
# (grep is not one: scripts grep what `nvidia-smi` or `pip list` would print, and a grep that matches nothing fails
# a `set -o pipefail` script, where the recorded command's empty answer passes.)
TEXT_TOOLS = ("basename", "cat", "cut", "date", "dirname", "expr", "head", "nproc", "readlink", "realpath", "seq",
              "sort", "tail", "tr", "uniq", "wc")
SOURCED = "__slipstream_sourced__"  # the record a model-flag file writes when it is sourced
MISSING = "__slipstream_missing__"  # the record of a `source` whose file is not where the script looks
# A `source` of a model-flag file that is not where the script looks (slime's scripts/low_precision/ ones look in
# scripts/low_precision/../scripts/models/) reads the file of that name in scripts/models/, and is recorded.
# Each command is recorded in a file of its own, named by the time it ran: the two ends of a pipeline run at once.
# (It traces nothing: under `set -x` a trace line of the handler went to a pipe whose reader had exited, and
# SIGPIPE ended the handler before it recorded `ray job submit ... 2>&1 | tee LOG`.)
PRELUDE = f"""command_not_found_handle() {{
  {{ set +x; }} 2>/dev/null
  printf '%s\\0' "$@" > "$SLIPSTREAM_RECORD/${{EPOCHREALTIME/./}}-$BASHPID"
}}
{SOURCED}() {{ command_not_found_handle {SOURCED} "$@"; }}
source() {{
  if [ ! -e "$1" ] && [ -e "$SLIPSTREAM_MODELS/${{1##*/}}" ]; then
    command_not_found_handle {MISSING} "$1"; builtin source "$SLIPSTREAM_MODELS/${{1##*/}}" "${{@:2}}"
  else builtin source "$@"; fi
}}
"""
TEE = """#!/bin/bash
exec cat > /dev/null
"""  # a pipeline's reader that writes no file (`python3 train.py ... | tee LOG`): it reads to the end, as tee does
MKTEMP = """#!/bin/bash
path="$SLIPSTREAM_SANDBOX/tmp/mktemp.$RANDOM$RANDOM"
if [ "$1" = "-d" ]; then mkdir -p "$path"; else : > "$path"; fi
echo "$path"
"""
# What a script reads from its environment (a cluster's head address, a base folder), so it runs to its command.
ENVIRONMENT = {"MASTER_ADDR": "127.0.0.1", "MLP_WORKER_0_HOST": "127.0.0.1", "BASE_FOLDER": "/root",
               "WANDB_KEY": "wandb-key", "WANDB_API_KEY": "wandb-key", "NUM_GPUS": "8", "BASE_DIR": "/root"}
ABSOLUTE_PROGRAM = re.compile(r"^\s*(?:exec\s+|sudo\s+)?/(?:usr/)?(?:local/)?s?bin/\S+", re.MULTILINE)
SLIME_HOME = "/root/slime"  # where slime's scripts expect the checkout (`source /root/slime/scripts/models/...`)


@dataclass
class Captured:
    """What running one script recorded: the entry point and its argv (None when no `train*.py` was started),
    the model-flag files it sourced, every other command it would have run, and bash's exit status and stderr."""

    script: str
    entry: str | None = None
    argv: list[str] = field(default_factory=list)
    sourced: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    returncode: int = 0
    stderr: str = ""


def run_scripts(checkout: Path) -> list[Path]:
    """slime's run scripts, relative to the checkout: scripts/run-*.sh, scripts/low_precision/*.sh, examples/**.sh
    (scripts/models/*.sh are the model-flag files they source)."""
    found = [*checkout.glob("scripts/run-*.sh"), *checkout.glob("scripts/low_precision/*.sh"),
             *checkout.glob("examples/**/*.sh")]
    return sorted(path.relative_to(checkout) for path in found)


def export_checkout(source: Path, into: Path) -> Path:
    """A writable copy of slime's checkout under `into`: a bare git repository's HEAD (`git archive`), or a work
    tree copied as it is. The sandbox edits the copy (model-flag files record their sourcing), never the source."""
    target = into / "slime"
    if (source / "HEAD").is_file() and (source / "objects").is_dir():  # a bare repository (the mirror)
        target.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(source), "archive", "HEAD"], capture_output=True, check=True)
        with tempfile.TemporaryFile() as tar_file:
            tar_file.write(archive.stdout)
            tar_file.seek(0)
            with tarfile.open(fileobj=tar_file) as tar:
                tar.extractall(target, filter="data")
    elif (source / "scripts").is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".git"))
    else:
        raise ValueError(f"{source}: not a slime checkout (no scripts/ folder) nor a bare git repository of one")
    for model_file in (target / "scripts" / "models").glob("*.sh"):
        model_file.write_text(f'{SOURCED} "${{BASH_SOURCE[0]}}"\n' + model_file.read_text(encoding="utf-8"),
                              encoding="utf-8")
    return target


def capture(checkout: Path, script: Path, sandbox: Path, *, timeout: float = 30.0) -> Captured:
    """Run `script` (relative to the exported `checkout`) in a fresh sandbox folder and read what it recorded.
    Paths under /root/slime (the checkout's place in slime's container) are read as the exported checkout."""
    captured = Captured(script=script.as_posix())
    text = (checkout / script).read_text(encoding="utf-8")
    if (absolute := ABSOLUTE_PROGRAM.search(text)) is not None:
        captured.returncode, captured.stderr = -1, f"runs a program by absolute path: {absolute.group(0).strip()}"
        return captured
    runnable = checkout / script.with_name(f".slipstream-{script.name}")
    runnable.write_text(text.replace(SLIME_HOME, str(checkout)), encoding="utf-8")
    sandbox.mkdir(parents=True)
    tools, record = _prepare_sandbox(sandbox)
    env = {**ENVIRONMENT, "PATH": str(tools), "HOME": str(sandbox / "home"), "TMPDIR": str(sandbox / "tmp"),
           "BASH_ENV": str(sandbox / "prelude.sh"), "SLIPSTREAM_RECORD": str(record),
           "SLIPSTREAM_SANDBOX": str(sandbox), "SLIPSTREAM_MODELS": str(checkout / "scripts" / "models")}
    try:
        done = subprocess.run([shutil.which("bash") or "/bin/bash", str(runnable)], cwd=runnable.parent, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False)
        captured.returncode, captured.stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired:
        captured.returncode, captured.stderr = -1, f"did not finish in {timeout:.0f} s"
    finally:
        runnable.unlink()
    entry_at = -1  # the entry point's record
    for index, command in enumerate(_records(record)):
        if command[0] == SOURCED:
            captured.sourced.extend(command[1:])
        elif command[0] == MISSING:
            where = os.path.relpath(command[1], checkout)
            captured.notes.append(f"sources {where}, which is not in slime's tree: read scripts/models/"
                                  f"{os.path.basename(command[1])}")
        elif captured.entry is None and (found := _entry_point(command)) is not None:
            (captured.entry, captured.argv), entry_at = found, index
        elif index == entry_at + 1 and command[0].startswith("--"):
            # the line before ends without its `\`: bash ran the rest of the command line as a command of its own
            captured.argv.extend(command)
            captured.notes.append(f"its command line continues after a line without `\\` ({command[0]} ...): "
                                  "read as one command line")
        else:
            captured.commands.append(command)
    return captured


def _prepare_sandbox(sandbox: Path) -> tuple[Path, Path]:
    tools = sandbox / "bin"
    for folder in (tools, sandbox / "home", sandbox / "tmp"):
        folder.mkdir()
    for name in TEXT_TOOLS:
        if (real := shutil.which(name)) is not None:
            (tools / name).symlink_to(real)
    for name, text in (("mktemp", MKTEMP), ("tee", TEE)):
        (tools / name).write_text(text, encoding="utf-8")
        (tools / name).chmod(0o755)
    (sandbox / "prelude.sh").write_text(PRELUDE, encoding="utf-8")
    record = sandbox / "record"
    record.mkdir()
    return tools, record


def _records(record: Path) -> list[list[str]]:
    """The recorded commands in the order they ran (by the microsecond, then the process id)."""
    files = sorted(record.iterdir(), key=lambda path: tuple(int(part) for part in path.name.split("-")))
    return [path.read_bytes().decode("utf-8", errors="replace").split("\0")[:-1] for path in files]


def _entry_point(command: list[str]) -> tuple[str, list[str]] | None:
    """(train or train_async, the argv after it) when the command runs slime's entry point (directly, under
    `ray job submit ... --`, or as `python3 -u /path/train.py`)."""
    for index, token in enumerate(command):
        if os.path.basename(token) in ENTRY_SCRIPTS and index > 0:
            return os.path.basename(token).removesuffix(".py"), command[index + 1:]
    return None
