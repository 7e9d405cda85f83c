"""slime's logging flags as a slime user means them: the metric families of --log-multi-turn, --log-reward-category
and --log-correct-samples, the rollout and eval log hooks (slime's signatures, a true return taking the logging
over, a raising hook reported by name while the run goes on), and --custom-config-path's keys on the plugins' args.
"""

from __future__ import annotations

import pickle
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from actors.config import RunConfig, build_config
from actors.config.settings_errors import SettingsError
from actors.evaluator.rounds import EvalRounds
from actors.extensions.load import eval_log_hook
from actors.learner.rollout_log import RolloutLog
from actors.slime_compat import Sample as SlimeSample
from actors.slime_compat import build_args
from bus.schema import Batch, PromptGroup, Sample, ScoredGroup
from policies.rewards import REWARD_EXTRAS
from tests.actors.test_slime_flags import configure

HERE = "tests.actors.test_slime_logging"


def _record(args: Any, *call: Any) -> None:
    """What a hook was called with, kept in the file its custom config names (the hook runs in the module copy the
    plugin loader imports, which need not be pytest's)."""
    path = Path(args.calls_file)
    calls = pickle.loads(path.read_bytes()) if path.exists() else []
    path.write_bytes(pickle.dumps([*calls, call]))


def calls(path: Path) -> list[tuple[Any, ...]]:
    return pickle.loads(path.read_bytes()) if path.exists() else []


def record_and_log_myself(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    _record(args, rollout_id, vars(args), samples, dict(rollout_extra_metrics), rollout_time)
    return True


def add_a_metric(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    rollout_extra_metrics["rollout/my_longest"] = max(s.response_length for s in samples)
    return False


def broken(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    raise RuntimeError("my dashboard is down")


def record_eval(rollout_id, args, data, extra_metrics):
    _record(args, rollout_id, data, dict(extra_metrics))
    return args.eval_hook_takes_over


def broken_eval(rollout_id, args, data, extra_metrics):
    raise KeyError("score")


def sample(index: int, response: int, *, reward: float | None = 1.0, trained: int | None = None,
           log_prob: float = -0.5, metadata: dict[str, Any] | None = None, status: str = "completed",
           group: str = "g") -> Sample:
    prompt = 3
    mask = np.ones(response, dtype=np.int8)
    if trained is not None:
        mask[trained:] = 0  # the tail is environment output
    return Sample(sample_id=f"{group}/{index}", group_id=group, index=index, prompt="1+1=", prompt_tokens=prompt,
                  tokens=np.arange(prompt + response, dtype=np.int32), response="x" * response,
                  response_length=response, reward=reward, loss_mask=mask,
                  rollout_log_probs=np.full(response, log_prob, dtype=np.float32),
                  token_versions=np.zeros(response, dtype=np.int32), status=status,
                  metadata={"data_index": 0, **(metadata or {})})


def batch(samples: list[Sample], batch_id: int = 3) -> Batch:
    return Batch(batch_id=batch_id, samples=samples, staleness=[0] * len(samples))


def rollout_log(**settings: Any) -> tuple[RolloutLog, Counter[str]]:
    counters: Counter[str] = Counter()
    config = build_config({"rollout_max_response_len": 8, **settings})
    return RolloutLog(config, structlog.get_logger("test"), counters), counters


@pytest.mark.unit
def test_log_multi_turn_adds_slimes_response_length_and_round_metrics() -> None:
    log, _ = rollout_log(log_multi_turn=True)
    samples = [sample(0, 8, trained=3, metadata={"turns": 2}), sample(1, 4, trained=4, metadata={"turns": 1}),
               sample(2, 6, trained=2, metadata={"round_number": 5, "turns": 9})]  # a generate plugin's own count
    metrics = log(batch(samples), {}, 0.0)
    assert metrics == {
        "multi_turn/raw_response_length/response_length_mean": 6.0,
        "multi_turn/raw_response_length/response_length_max": 8.0,
        "multi_turn/raw_response_length/response_length_min": 4.0,
        "multi_turn/raw_response_length/response_length_clip_ratio": pytest.approx(1 / 3),  # 8 reached the cap
        "multi_turn/wo_obs_response_length/response_length_mean": 3.0,
        "multi_turn/wo_obs_response_length/response_length_max": 4.0,
        "multi_turn/wo_obs_response_length/response_length_min": 2.0,
        "multi_turn/multi_turn_metric/round_number_mean": pytest.approx(8 / 3),
        "multi_turn/multi_turn_metric/round_number_max": 5.0,
        "multi_turn/multi_turn_metric/round_number_min": 1.0,
    }
    assert rollout_log()[0](batch(samples), {}, 0.0) == {}  # off by default


@pytest.mark.unit
def test_log_reward_category_gives_each_values_share_of_the_batch() -> None:
    log, _ = rollout_log(log_reward_category="verdict")
    samples = [sample(0, 2, metadata={REWARD_EXTRAS: {"verdict": "wrong_format"}}),
               sample(1, 2, metadata={REWARD_EXTRAS: {"verdict": "correct"}}),
               sample(2, 2, metadata={REWARD_EXTRAS: {"verdict": "wrong_format"}}),
               sample(3, 2, metadata={"verdict": "timeout"}),  # the sample's own metadata, failing a reward field
               sample(4, 2)]  # neither: in no share
    assert log(batch(samples), {}, 0.0) == {"rollout/error_cat/correct": 0.2, "rollout/error_cat/timeout": 0.2,
                                            "rollout/error_cat/wrong_format": 0.4}


@pytest.mark.unit
def test_log_correct_samples_spreads_the_correct_lengths_over_quarters_and_gives_their_entropy() -> None:
    log, _ = rollout_log(log_correct_samples=True)  # quarters of 8 tokens: <=2, <=4, <=6, <=8
    samples = [sample(0, 1, log_prob=-0.2), sample(1, 2, log_prob=-0.4), sample(2, 7, trained=2, log_prob=-0.6),
               sample(3, 5, reward=0.0, log_prob=-9.0)]  # not correct: counts nowhere
    metrics = log(batch(samples), {}, 0.0)
    assert metrics == {"rollout/correct_length/p25": pytest.approx(2 / 3), "rollout/correct_length/p50": 0.0,
                       "rollout/correct_length/p75": 0.0, "rollout/correct_length/p100": pytest.approx(1 / 3),
                       "rollout/correct_entropy": pytest.approx(0.4)}


@pytest.mark.unit
def test_the_rollout_log_hook_gets_slimes_arguments_and_a_true_return_takes_the_logging_over(tmp_path: Path) -> None:
    made = tmp_path / "calls.pkl"
    log, _ = rollout_log(custom_rollout_log_function_path=f"{HERE}.record_and_log_myself", log_multi_turn=True,
                         custom_config={"calls_file": str(made), "my_dashboard": "http://dash"})
    samples = [sample(0, 2, metadata={"turns": 1}), sample(1, 4, reward=0.0, metadata={"turns": 2})]
    assert log(batch(samples, batch_id=3), {"rollout/reward_mean": 0.5}, 12.5) == {}
    [(rollout_id, args, seen, metrics, rollout_time)] = calls(made)
    assert rollout_id == 2  # slime's ids start at 0; our batches at 1
    assert args["my_dashboard"] == "http://dash" and args["rollout_max_response_len"] == 8
    assert [type(s) for s in seen] == [SlimeSample, SlimeSample]
    assert [(s.response_length, s.reward, s.status) for s in seen] == [(2, 1.0, SlimeSample.Status.COMPLETED),
                                                                      (4, 0.0, SlimeSample.Status.COMPLETED)]
    assert metrics["rollout/reward_mean"] == 0.5 and "multi_turn/multi_turn_metric/round_number_max" in metrics
    assert rollout_time == 12.5


@pytest.mark.unit
def test_a_false_return_keeps_the_default_metrics_with_what_the_hook_added() -> None:
    log, _ = rollout_log(custom_rollout_log_function_path=f"{HERE}:add_a_metric")
    assert log(batch([sample(0, 2), sample(1, 5)]), {"rollout/reward_mean": 1.0}, 1.0) == {
        "rollout/reward_mean": 1.0, "rollout/my_longest": 5}


@pytest.mark.unit
def test_a_raising_rollout_hook_is_reported_by_name_and_the_default_metrics_are_written() -> None:
    log, counters = rollout_log(custom_rollout_log_function_path=f"{HERE}.broken")
    with capture_logs() as logged:
        assert log(batch([sample(0, 2)]), {"rollout/reward_mean": 1.0}, 1.0) == {"rollout/reward_mean": 1.0}
    [warning] = [entry for entry in logged if entry["log_level"] == "warning"]
    assert warning["hook"] == f"{HERE}.broken" and warning["flag"] == "--custom-rollout-log-function-path"
    assert "my dashboard is down" in warning["error"]
    assert counters["log_hook.failures"] == 1


def _eval_config(tmp_path: Path, **settings: Any) -> RunConfig:
    held = tmp_path / "held.jsonl"
    held.write_text('{"input": "2+2=", "label": "4"}\n{"input": "3+3=", "label": "6"}\n')
    return build_config({"eval_prompt_data": ["held", str(held)], "eval_interval": 2, "n_samples_per_eval_prompt": 2,
                         **settings})


class Writer:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append((step, metrics))


def _eval_round(config: RunConfig) -> tuple[list[tuple[int, dict[str, Any]]], Counter[str]]:
    """One round at version 4 of both prompts, two samples each: rewards 1, 0 | 0, 0 (the last truncated)."""
    counters: Counter[str] = Counter()
    writer = Writer()
    queue: deque[PromptGroup] = deque()
    log = structlog.get_logger("test")
    rounds = EvalRounds(config, queue, writer, log, log_hook=eval_log_hook(config, log, counters))  # type: ignore[arg-type]
    rounds.start(4)
    for number, (group, rewards) in enumerate(zip(list(queue), [(1.0, 0.0), (0.0, 0.0)], strict=True)):
        samples = [sample(i, 2 + i, reward=r, status="truncated" if (number, i) == (1, 1) else "completed",
                          group=group.group_id) for i, r in enumerate(rewards)]
        rounds.record(ScoredGroup(lease_id="lease", group_id=group.group_id, samples=samples, worker_id="rollout-0"))
    return writer.rows, counters


@pytest.mark.unit
def test_the_eval_log_hook_gets_slimes_data_and_a_true_return_leaves_only_the_rounds_mark(tmp_path: Path) -> None:
    made = tmp_path / "calls.pkl"
    config = _eval_config(tmp_path, custom_eval_rollout_log_function_path=f"{HERE}:record_eval",
                          custom_config={"calls_file": str(made), "eval_hook_takes_over": True})
    rows, _ = _eval_round(config)
    [(rollout_id, data, metrics)] = calls(made)
    assert rollout_id == 3  # the round of version 4 evaluates the weights after slime's rollout 3
    assert list(data) == ["held"]
    assert data["held"]["rewards"] == [1.0, 0.0, 0.0, 0.0]
    assert data["held"]["truncated"] == [False, False, False, True]
    assert [s.response_length for s in data["held"]["samples"]] == [2, 3, 2, 3]
    assert metrics["eval/held/mean_reward"] == 0.25 and metrics["eval/held/pass@2"] == 0.5
    assert rows == [(4, {"eval/held/mean_reward": 0.25})]  # what tells a restarted evaluator the round is written

    rows, _ = _eval_round(_eval_config(tmp_path, custom_eval_rollout_log_function_path=f"{HERE}:record_eval",
                                       custom_config={"calls_file": str(made), "eval_hook_takes_over": False}))
    assert rows[0][1]["eval/held/pass@2"] == 0.5  # the default metrics, as without a hook


@pytest.mark.unit
def test_a_raising_eval_hook_is_reported_and_the_round_is_written(tmp_path: Path) -> None:
    with capture_logs() as logged:
        rows, counters = _eval_round(_eval_config(tmp_path,
                                                  custom_eval_rollout_log_function_path=f"{HERE}.broken_eval"))
    assert rows[0][1]["eval/held/pass@2"] == 0.5
    assert counters["log_hook.failures"] == 1
    assert any(entry.get("hook") == f"{HERE}.broken_eval" for entry in logged)


@pytest.mark.unit
def test_custom_config_keys_are_attributes_of_the_plugins_args(tmp_path: Path) -> None:
    path = tmp_path / "custom.yaml"
    path.write_text("judge_temperature: 0.3\nrubric: [format, answer]\n")
    config, _ = configure(["--custom-config-path", str(path), "--rollout-batch-size", "4"])
    args = build_args(config)
    assert args.judge_temperature == 0.3 and args.rubric == ["format", "answer"]
    assert args.rollout_batch_size == 4  # beside every setting, as slime's args


@pytest.mark.unit
def test_a_custom_config_key_that_names_a_slime_flag_is_that_flag_overriding_the_command_line(tmp_path: Path) -> None:
    """slime merges the YAML into its args after parsing: its train/infer mismatch helper turns TIS on there."""
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_level: token\nlr: 2.0e-6\n")
    config, args = configure(["--custom-config-path", str(path), "--lr", "1e-6"])
    assert (config.policy.off_policy_correction, config.trainer.lr) == ("tis", 2.0e-6)
    assert any("lr: 2e-06 overrides --lr" in note for note in args.slime_translation.notes)
    assert build_args(config).tis_level == "token"  # the plugin's own setting, on its args


@pytest.mark.unit
@pytest.mark.parametrize(("text", "message"), [
    ("my_key: 2\nsglang_dp_size: 2\n", "sglang_dp_size name run settings or SGLang server settings it does not "
     "set"),
    ("- a\n- b\n", "expected a mapping of names to values, got list"),
    ("a: [unclosed\n", "cannot read it"),
])
def test_a_custom_config_that_would_shadow_a_setting_or_is_no_mapping_is_refused_by_name(
        tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "custom.yaml"
    path.write_text(text)
    with pytest.raises((ValueError, SettingsError), match=message):
        configure(["--custom-config-path", str(path)])


@pytest.mark.unit
def test_slimes_logging_flags_reach_their_settings() -> None:
    config, _ = configure(["--log-multi-turn", "--log-reward-category", "verdict", "--log-correct-samples",
                           "--wandb-run-id", "abc123", "--save-hf", "/exports/iter_{rollout_id}",
                           "--custom-rollout-log-function-path", "my.hooks.log_rollout",
                           "--custom-eval-rollout-log-function-path", "my.hooks.log_eval"])
    logging = config.logging
    assert logging.log_multi_turn and logging.log_correct_samples and logging.log_reward_category == "verdict"
    assert logging.wandb_run_id == "abc123" and config.learner.save_hf == "/exports/iter_{rollout_id}"
    assert logging.custom_rollout_log_function_path == "my.hooks.log_rollout"
    assert logging.custom_eval_rollout_log_function_path == "my.hooks.log_eval"
    with pytest.raises(SettingsError, match=r"--save-hf /exports/\{step\}: the only placeholder is \{rollout_id\}"):
        configure(["--save-hf", "/exports/{step}"])
