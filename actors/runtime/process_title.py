"""What `ps`, `top`, `pgrep -f` and `py-spy` call each process of a run.

Every actor is forked from the template process (`actors.launch.zygote`), so without this each one would show
that template's command line, and finding the learner to profile or kill it would mean reading the launcher's log.
The full title (`slipstream learner-0 node 0 run /runs/x`) is the command line `ps -f` and `pgrep -f` match; the
short name (`learner-0`, what `top` and `ps -e` show, at most 15 bytes on Linux) is the main thread's name.
"""

from __future__ import annotations

from pathlib import Path

import setproctitle

TITLE_PREFIX = "slipstream"
SHORT_NAME_BYTES = 15  # the kernel's limit on a thread's name (TASK_COMM_LEN - 1)


def name_process(name: str, *, node: int | None = None, run_dir: Path | None = None) -> None:
    """Title this process `slipstream NAME [node N] [run DIR]`; its short name is NAME (cut to 15 bytes)."""
    parts = [TITLE_PREFIX, name]
    if node is not None:
        parts += ["node", str(node)]
    if run_dir is not None:
        parts += ["run", str(run_dir)]
    setproctitle.setproctitle(" ".join(parts))
    setproctitle.setthreadtitle(name.encode()[:SHORT_NAME_BYTES].decode(errors="ignore"))
