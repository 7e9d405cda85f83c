"""slime's SFT flags: `--num-epoch` sets the run's length from the dataset as slime derives it, and slime's SFT
rollout function becomes our SFT on whole conversations (its records unlabelled, reward 0, one sample each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.config import config_from_args
from actors.config.run import RunConfig
from actors.config.settings_errors import SettingsError
from tests.actors.test_slime_flags import parse

SFT_ROLLOUT = "slime.rollout.sft_rollout.generate_rollout"


def _records(tmp_path: Path, count: int) -> Path:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": str(i)},
                                                     {"role": "assistant", "content": "ok"}]}) + "\n"
                            for i in range(count)) + "not json\n", encoding="utf-8")
    return data


def _configure(argv: list[str]) -> tuple[RunConfig, list[str]]:
    args = parse(argv)
    config = config_from_args(args)
    return config, args.slime_translation.notes


@pytest.mark.unit
@pytest.mark.parametrize(("records", "batch", "epochs", "rollouts"), [(10, 4, 3, 6), (12, 4, 2, 6), (5, 5, 1, 1)])
def test_num_epoch_is_whole_batches_of_the_kept_records_times_the_epochs(tmp_path: Path, records: int, batch: int,
                                                                         epochs: int, rollouts: int) -> None:
    """The bad line is left out as the buffer leaves it out, and a last partial batch does not count (slime:
    num_epoch x len(dataset) // rollout_batch_size)."""
    config, _ = _configure(["--prompt-data", str(_records(tmp_path, records)), "--input-key", "messages",
                            "--label-key", "none", "--rollout-batch-size", str(batch), "--num-epoch", str(epochs)])
    assert config.learner.num_rollout == rollouts


@pytest.mark.unit
def test_a_given_num_rollout_wins_over_num_epoch(tmp_path: Path) -> None:
    config, _ = _configure(["--prompt-data", str(_records(tmp_path, 10)), "--input-key", "messages",
                            "--label-key", "none", "--num-epoch", "3", "--num-rollout", "2"])
    assert config.learner.num_rollout == 2


@pytest.mark.unit
def test_num_epoch_over_a_dataset_smaller_than_a_batch_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"--num-epoch 2: .*chats.jsonl holds fewer usable records than one "
                                            r"batch \(--rollout-batch-size 8\)"):
        _configure(["--prompt-data", str(_records(tmp_path, 5)), "--input-key", "messages", "--label-key", "none",
                    "--rollout-batch-size", "8", "--num-epoch", "2"])
    with pytest.raises(SettingsError, match=r"--num-epoch 2 counts --prompt-data's records: .*no such file"):
        _configure(["--prompt-data", str(tmp_path / "missing.jsonl"), "--num-epoch", "2"])


@pytest.mark.unit
def test_slimes_sft_rollout_function_is_our_sft_on_unlabelled_conversations(tmp_path: Path) -> None:
    config, notes = _configure(["--rollout-function-path", SFT_ROLLOUT, "--loss-type", "sft_loss",
                                "--debug-train-only", "--disable-compute-advantages-and-returns",
                                "--prompt-data", str(_records(tmp_path, 4)), "--input-key", "messages"])
    assert config.rollout.rollout_function_path is None and config.policy.loss_type == "sft"
    assert config.data.label_key is None and config.reward.rm_type == "zero"
    assert config.rollout.n_samples_per_prompt == 1 and not config.learner.debug_train_only
    assert any(note.startswith("--debug-train-only (slime's SFT starts no engines") for note in notes)


@pytest.mark.unit
def test_slimes_sft_rollout_function_keeps_what_is_given_and_needs_the_sft_loss() -> None:
    config, _ = _configure(["--rollout-function-path", SFT_ROLLOUT, "--loss-type", "sft_loss", "--label-key",
                            "answer", "--rm-type", "math", "--n-samples-per-prompt", "2"])
    assert (config.data.label_key, config.reward.rm_type, config.rollout.n_samples_per_prompt) == ("answer", "math", 2)
    with pytest.raises(ValueError, match=f"--rollout-function-path {SFT_ROLLOUT} is slime's SFT data path: it "
                                         "needs --loss-type sft_loss"):
        _configure(["--rollout-function-path", SFT_ROLLOUT])
