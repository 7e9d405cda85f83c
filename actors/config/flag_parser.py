"""The launcher's argument parser: a bad flag is a short error that names it, not 350 lines of usage.

argparse prints the whole usage before its error, and the launcher has several hundred flags (its own and every
slime flag), so a mistyped flag scrolled the terminal and left the one line that said what was wrong at the
bottom of a wall. Here the error comes alone, with the flags whose names are closest to an unknown one.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn

SUGGESTIONS = 3


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors go without the usage, and whose unknown flags come with their near names
    (`--eval-max-prompts`: did you mean --eval-max-prompt-len?)."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error("unrecognized arguments: " + " ".join(unknown) + self._suggest(unknown))
        return parsed

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help-all lists every flag\n")

    def _suggest(self, unknown: Sequence[str]) -> str:
        known = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        flags = [token.split("=", 1)[0] for token in unknown if token.startswith("--")]  # not the values
        return "".join(f"\n  {hint}" for hint in near_name_hints(flags, known))


def near_name_hints(unknown: Sequence[str], known: Sequence[str]) -> list[str]:
    """"NAME: did you mean A or B?" for each unknown name that has known names close to it (a flag, a YAML key)."""
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=SUGGESTIONS, cutoff=0.7)
        if close:
            hints.append(f"{name}: did you mean {' or '.join(close)}?")
    return hints
