"""`launcher.py --help` is one screen of the flags a first run needs and says where the rest is; every flag is in
`--help-all`, each with a help of its own; name-valued flags list the names their registries hold."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from actors.config.help import FIRST_RUN, STALENESS_GUIDE, section_names
from actors.config.run import SECTIONS
from launcher import build_parser
from policies.registry import (
    ADVANTAGE_ESTIMATORS,
    CORRECTIONS,
    FILTERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    REWARDS,
    BuiltinNames,
    Registry,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SCREEN_LINES = 150


def _shown(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    """What the launcher prints for `argv` on an 80-column terminal (argparse wraps to the terminal's width)."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    assert exited.value.code == 0
    return capsys.readouterr().out


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if action.option_strings]


def _appears(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


@pytest.mark.unit
def test_help_fits_a_screen_and_names_where_the_rest_is(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    text = _shown(capsys, monkeypatch, "--help")
    lines = text.splitlines()
    assert len(lines) <= SCREEN_LINES, f"--help is {len(lines)} lines"
    usage = text.split("\n\n", 1)[0].splitlines()
    assert usage[0].startswith("usage: launcher.py --head") and len(usage) <= 2  # no synopsis of every flag
    ending = " ".join(text.rstrip().rsplit("\n\n", 1)[-1].split())  # the last paragraph, however many sections
    assert "Every flag: --help-all." in ending and "--help-section NAME" in ending and "megatron" in ending
    for topic in FIRST_RUN:
        assert all(_appears(flag, text) for flag in topic.flags)
    assert STALENESS_GUIDE in " ".join(text.split())  # the off-policy lines say how to choose


@pytest.mark.unit
def test_the_first_run_selection_names_real_flags_once() -> None:
    parser = build_parser()
    named = [flag for topic in FIRST_RUN for flag in topic.flags]
    assert len(named) == len(set(named))
    assert set(named) <= set(parser._option_string_actions)


@pytest.mark.unit
def test_every_flag_is_in_the_full_help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = _shown(capsys, monkeypatch, "--help-all")
    missing = [option for action in _flags(build_parser()) for option in action.option_strings
               if option.startswith("--") and not _appears(option, text)]
    assert not missing
    assert text.splitlines()[0].startswith("usage: launcher.py --head") and "[--" not in text.split("\n\n", 1)[0]


@pytest.mark.unit
def test_each_flag_is_in_the_help_section_of_its_group(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    sections = section_names(parser)
    assert {"cluster", "actors", "run", "policy", "slime", *SECTIONS} <= set(sections)
    covered: set[str] = set()
    for name, group in sections.items():
        text = _shown(capsys, monkeypatch, "--help-section", name)
        flags = [action.option_strings[-1] for action in group._group_actions]
        assert all(_appears(flag, text) for flag in flags), name
        covered.update(flags)
    help_flags = {"--help", "--help-all", "--help-section"}
    assert {action.option_strings[-1] for action in _flags(parser)} - help_flags == covered


@pytest.mark.unit
def test_no_flag_help_is_its_own_name_spelled_out() -> None:
    """A field without a description used to fall back to its name ("tis clip", "eps clip c"): the next one fails
    here."""
    weak = []
    for action in _flags(build_parser()):
        words = (action.help or "").split(" (default:")[0].strip().lower()
        names = {option.lstrip("-").replace("-", " ") for option in action.option_strings} | {
            action.dest.replace("_", " ")}
        if not words or words in names or words in ("seconds", "number"):
            weak.append(f"{action.option_strings[0]}: {action.help!r}")
    assert not weak


@pytest.mark.unit
def test_group_descriptions_are_whole_sentences() -> None:
    """A section's description is its docstring's first paragraph, not its first line (which stopped two of them
    mid-sentence)."""
    descriptions = {group.title: group.description for group in build_parser()._action_groups if group.description}
    assert {f"{name} settings" for name in SECTIONS} <= set(descriptions)
    unfinished = {title: text for title, text in descriptions.items() if not text.rstrip().endswith((".", ".)"))}
    assert not unfinished
    assert descriptions["lora settings"].endswith("Names as in PEFT and slime's LoRA recipe.")
    assert descriptions["agent settings"].endswith("each rollout worker serves (actors/rollout/agent.py).")


@pytest.mark.unit
@pytest.mark.parametrize(("flag", "names"), [
    ("--advantage-estimator", lambda: ADVANTAGE_ESTIMATORS.names()),
    ("--loss-type", lambda: POLICY_LOSSES.names()),
    ("--kl-loss-type", lambda: KL_ESTIMATORS.names()),
    ("--off-policy-correction", lambda: CORRECTIONS.names()),
    ("--rm-type", lambda: [*REWARDS.names(), "remote_rm"]),
    ("--dynamic-sampling-filter-path", lambda: FILTERS.names()),
    ("--rollout-engine", lambda: ["torch", "sglang"]),
    ("--train-backend", lambda: ["torch", "megatron"]),
])
def test_name_valued_flags_list_their_built_in_names(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch, flag: str, names) -> None:
    parser = build_parser()
    action = parser._option_string_actions[flag]
    text = " ".join(parser._get_formatter()._expand_help(action).split())
    listed = text.split("one of ", 1)[1]
    assert all(re.search(rf"\b{name}\b", listed) for name in names()), text
    assert "or a module:attr plugin path" in listed


@pytest.mark.unit
def test_names_are_read_from_the_registry_when_shown() -> None:
    registry: Registry = Registry("thing", ())
    names = BuiltinNames(registry.listed_names, plugins=False)
    registry.register("first")(len)
    assert str(names) == "first"
    registry.register("added_later")(abs)  # a built-in added after the flag was declared is listed too
    assert str(names) == "added_later, first"


@pytest.mark.unit
def test_the_staleness_guide_the_help_points_to_exists() -> None:
    path, heading = STALENESS_GUIDE.split(", ", 1)
    assert f"## {heading.strip(chr(34))}\n" in (REPO_ROOT / path).read_text(encoding="utf-8")
