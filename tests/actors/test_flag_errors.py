"""A bad launcher flag is a short error that names it, not the usage of several hundred flags above one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.config import config_from_args
from launcher import build_parser


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.unit
def test_a_mistyped_flag_is_named_with_the_flags_it_is_close_to(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _error(capsys, "--head", "--rollout-batchsize", "4", "--lr=1e-5", "--lrr=3", "--zzzz")
    assert lines[0] == "launcher.py: error: unrecognized arguments: --rollout-batchsize 4 --lrr=3 --zzzz"
    assert lines[1].startswith("  --rollout-batchsize: did you mean --rollout-batch-size")
    assert lines[2] == "  --lrr: did you mean --lr?"
    assert lines[3:] == ["launcher.py --help-all lists every flag"]  # nothing near --zzzz, and no usage


@pytest.mark.unit
def test_a_bad_value_is_its_error_alone(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _error(capsys, "--head", "--log-level", "loud")
    assert lines[0].startswith("launcher.py: error: argument --log-level: invalid choice: 'loud'")
    assert lines[1:] == ["launcher.py --help-all lists every flag"]


@pytest.mark.unit
def test_a_mistyped_yaml_key_is_named_with_the_keys_it_is_close_to(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rollout_batchsize: 16\ntrainer:\n  lr: 0.1\n  weight_decy: 0.01\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"section 'trainer': weight_decy \(weight_decy: did you mean weight_decay"):
        config_from_args(build_parser().parse_args(["--config", str(path)]))
    path.write_text("rollout_batchsize: 16\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown key\(s\) rollout_batchsize \(rollout_batchsize: did you mean "
                                         r"rollout_batch_size"):
        config_from_args(build_parser().parse_args(["--config", str(path)]))
