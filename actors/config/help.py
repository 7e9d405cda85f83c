"""The launcher's help: `--help` is one screen of the flags a first run needs; `--help-all` is every flag and
`--help-section NAME` one group of them.

The launcher has several hundred flags (its own, one per setting, Megatron's and every slime flag), and argparse's
help of all of them ran to 1,800 lines, 374 of them usage, with --prompt-data somewhere in the middle. The short help
is one named selection, `FIRST_RUN`, drawn by the same formatter as the full help, so a flag reads the same in both.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

STALENESS_GUIDE = "docs/policies.md, \"Choosing the staleness bound and a correction\""


class Topic(NamedTuple):
    """A heading of the short help, a line under it (or ""), and its flags, in the order they are shown."""

    heading: str
    note: str
    flags: tuple[str, ...]


# The short help: the flags of a first run of one's own (a model, a dataset, a reward) and of the knobs people come
# to an async RL trainer for. Every name must be a flag of the launcher (tests/actors/test_help.py checks it).
FIRST_RUN: tuple[Topic, ...] = (
    Topic("start", "", ("--head", "--head-address", "--node-rank", "--run-dir", "--config")),
    Topic("actors", "", ("--rollout-workers", "--reward-workers", "--custom-actor")),
    Topic("model", "", ("--hf-checkpoint", "--bf16", "--lora-rank")),
    Topic("data", "", ("--prompt-data", "--input-key", "--label-key", "--apply-chat-template")),
    Topic("rollout", "", ("--rollout-batch-size", "--n-samples-per-prompt", "--rollout-max-response-len",
                          "--rollout-temperature", "--rollout-engine")),
    Topic("reward", "", ("--rm-type", "--custom-rm-path")),
    Topic("training", "", ("--num-rollout", "--lr", "--advantage-estimator", "--loss-type", "--eps-clip",
                           "--eps-clip-high", "--use-kl-loss", "--kl-loss-coef")),
    Topic("off-policy", f"How to choose the bound and the correction: {STALENESS_GUIDE}.",
          ("--max-staleness", "--off-policy-correction", "--tis-clip")),
    Topic("checkpoints", "", ("--save", "--save-interval", "--load")),
    Topic("evaluation", "", ("--eval-prompt-data", "--eval-interval")),
)
USAGE = ("%(prog)s --head [FLAGS]                                  (the head node)\n"
         "       %(prog)s --head-address tcp://HOST:PORT --node-rank N [FLAGS]  (every other node)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Append argparse's default only where it means something: run settings default to None on the command line
    (so a YAML file can set them) and carry their real default in their own help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        unset = action.default in (None, []) or (action.default is False and action.const is True)  # store_true
        if unset or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def section_names(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """--help-section's names: each flag group by the first word of its title ("megatron settings": megatron,
    "slime compatibility (...)": slime)."""
    return {group.title.split()[0]: group for group in parser._action_groups
            if group.title and group._group_actions and group.title != "options"}


def short_help(parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.add_text(parser.description)
    flags = parser._option_string_actions
    for topic in FIRST_RUN:
        formatter.start_section(topic.heading)
        formatter.add_text(topic.note or None)
        formatter.add_arguments([flags[flag] for flag in topic.flags])
        formatter.end_section()
    every = sum(1 for action in parser._actions if action.option_strings)
    formatter.add_text(f"These are {sum(len(t.flags) for t in FIRST_RUN)} of {every} flags. Every flag: "
                       f"--help-all. One group: --help-section NAME, NAME one of "
                       f"{', '.join(section_names(parser))}.")
    return formatter.format_help()


def section_help(parser: argparse.ArgumentParser, name: str) -> str:
    group = section_names(parser)[name]
    formatter = parser._get_formatter()
    formatter.start_section(group.title)
    formatter.add_text(group.description)
    formatter.add_arguments(group._group_actions)
    formatter.end_section()
    return formatter.format_help()


class _Show(argparse.Action):
    """Print one of the helps and exit, as argparse's own -h does."""

    def __init__(self, option_strings: Sequence[str], dest: str, render: Any, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)
        self.render = render

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        parser._print_message(self.render(parser, *([values] if isinstance(values, str) else [])), sys.stdout)
        parser.exit()


def add_help_flags(parser: argparse.ArgumentParser) -> None:
    """-h/--help, --help-all and --help-section; call last, when every group exists (their names are the choices).
    The parser is built with add_help=False and `usage=USAGE`."""
    parser.add_argument("-h", "--help", action=_Show, nargs=0, render=short_help,
                        help="the flags of a first run (this list)")
    parser.add_argument("--help-all", action=_Show, nargs=0, render=lambda p: p.format_help(),
                        help="every flag, by group")
    parser.add_argument("--help-section", action=_Show, metavar="NAME", choices=tuple(section_names(parser)),
                        render=section_help, help="one group's flags: %(choices)s")
