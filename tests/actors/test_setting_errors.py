"""A bad setting is named as the user gave it, with the value given (`--max-staleness -1: must be >= 0`), and every
bad value comes in one list with the file checks, before any actor starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.config import config_from_args
from actors.config.settings_errors import SettingsError
from actors.launch.node_roles import LaunchError
from launcher import build_parser, prepare


def _problems(*argv: str) -> SettingsError:
    with pytest.raises(SettingsError) as raised:
        config_from_args(build_parser().parse_args(list(argv)))
    return raised.value


@pytest.mark.unit
def test_a_bad_value_names_the_flag_and_the_value() -> None:
    assert _problems("--max-staleness", "-1").problems == ["--max-staleness -1: must be >= 0"]
    assert _problems("--rollout-engine", "vllm").problems == [
        "--rollout-engine vllm: expected one of torch, sglang, or a plugin factory path 'package.module:attr'"]
    assert _problems("--eval-prompt-data", "math").problems == [
        "--eval-prompt-data math: takes NAME PATH pairs, got 1 value(s)"]
    assert _problems("--off-policy-correction", "tiss").problems[0].startswith(
        "--off-policy-correction tiss: unknown off-policy correction 'tiss'; registered: icepop, mis, none, tis")


@pytest.mark.unit
def test_a_slime_flag_is_named_as_typed() -> None:
    assert _problems("--max-tokens-per-gpu", "0").problems == ["--max-tokens-per-gpu 0: must be >= 1"]


@pytest.mark.unit
def test_a_bad_value_from_the_config_file_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("buffer:\n  max_staleness: -1\nlr: fast\nrollout_top_p: 2\n", encoding="utf-8")
    problems = _problems("--config", str(path), "--rollout-top-p", "1.5").problems
    assert sorted(problems) == sorted([f"--config {path}: buffer.max_staleness -1: must be >= 0",
                                       f"--config {path}: lr fast: must be a number",
                                       "--rollout-top-p 1.5: must be <= 1.0"])  # the flag overrides the file


@pytest.mark.unit
def test_every_bad_value_is_reported_with_the_rules_they_hid() -> None:
    """A rule over several settings runs only once each of them is valid: it used to appear one rerun later."""
    problems = _problems("--lr", "-1", "--eps-clip-c", "0.5", "--max-staleness", "0",
                         "--update-weights-interval", "3").problems
    assert problems == ["--eps-clip-c 0.5: dual-clip bound must be > 1, got 0.5", "--lr -1.0: must be >= 0.0",
                        "max_staleness 0 must be at least update_weights_interval - 1 = 2: between pushes the "
                        "engines run weights up to 2 versions old"]


@pytest.mark.unit
def test_unknown_keys_come_in_the_same_list(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  learning_rate: 0.1\n", encoding="utf-8")
    problems = _problems("--config", str(path), "--max-staleness", "-1").problems
    assert problems == [f"--config {path}: unknown key(s) in section 'trainer': learning_rate",
                        "--max-staleness -1: must be >= 0"]


@pytest.mark.unit
def test_the_usable_config_keeps_the_valid_settings_for_the_file_checks() -> None:
    usable = _problems("--prompt-data", "train.jsonl", "--hf-checkpoint", "model", "--max-staleness", "-1").usable
    assert (usable.data.prompt_data, usable.model.hf_checkpoint, usable.buffer.max_staleness) == (
        "train.jsonl", "model", 2)
    # a rule over several settings names no one setting to leave out: each section is then taken on its own
    usable = _problems("--prompt-data", "train.jsonl", "--max-staleness", "0", "--update-weights-interval", "3").usable
    assert (usable.data.prompt_data, usable.weights.update_weights_interval) == ("train.jsonl", 3)


@pytest.mark.integration
def test_the_launcher_reports_bad_values_and_file_problems_in_one_list(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    run_dir = tmp_path / "run"
    with pytest.raises(LaunchError) as refused:
        prepare(["--head", "--run-dir", str(run_dir), "--prompt-data", str(empty), "--max-staleness", "-1",
                 "--hf-checkpoint", str(tmp_path / "no-model"), "--eps-clip-c", "1"])
    lines = str(refused.value).splitlines()
    assert lines[0] == "4 configuration problem(s), no actor started:"
    assert [line.strip() for line in lines[1:]] == [
        "--eps-clip-c 1.0: dual-clip bound must be > 1, got 1.0",
        "--max-staleness -1: must be >= 0",
        f"--prompt-data {empty}: no records (the file is empty)",
        f"--hf-checkpoint {tmp_path / 'no-model'}: not found: no such directory"]
    assert not run_dir.exists()
