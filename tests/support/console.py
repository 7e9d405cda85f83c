"""What a console check looks for, and the environment it runs a command in."""

from __future__ import annotations

import os
import re

from actors.runtime.logs import QUIET_ENV

PROGRESS_BAR = re.compile(r"Loading weights|Writing model shards|\d+/\d+ \[|it/s\]")


def env_without_quiet_switches(**extra: str) -> dict[str, str]:
    """This environment less the switches a command must set itself: a test process that already set them (an
    earlier test in the same worker called quiet_library_output) would hand them to the command and hide a
    command that forgot."""
    env = {name: value for name, value in os.environ.items() if name not in QUIET_ENV}
    return {**env, **extra}
