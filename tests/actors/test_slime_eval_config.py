"""slime's `--eval-config` (per-dataset eval settings, examples/eval_multi_task/multi_task.yaml's shape) and
`--eval-min-new-tokens`: each set's settings become its own view of the run, which samples and scores its groups."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.config import build_config, config_from_args
from actors.config.run import RunConfig
from actors.config.settings_errors import SettingsError
from actors.rollout.engine_factory import torch_kv_cache
from actors.rollout.generate import RolloutContext
from bus.schema import PromptGroup
from tests.actors.test_slime_flags import parse


def _yaml(tmp_path: Path, text: str) -> Path:
    for name in ("aime", "gpqa", "arith"):
        (tmp_path / f"{name}.jsonl").write_text('{"question": "1+1=", "answer": "2", "prompt": "x", "label": "y"}\n')
    path = tmp_path / "multi_task.yaml"
    path.write_text(text.replace("DIR", str(tmp_path)), encoding="utf-8")
    return path


MULTI_TASK = """eval:
  defaults:
    max_response_len: 16
    top_p: 0.7
  datasets:
    - name: aime
      path: DIR/aime.jsonl
      rm_type: deepscaler
      n_samples_per_eval_prompt: 16
      input_key: question
      label_key: answer
    - name: gpqa
      path: DIR/gpqa.jsonl
      rm_type: gpqa
      n_samples_per_eval_prompt: 2
      max_response_len: 8
      min_new_tokens: 3
"""


def _configure(argv: list[str]) -> RunConfig:
    return config_from_args(parse(argv))


@pytest.mark.unit
def test_each_dataset_of_the_eval_config_sees_its_own_settings_over_the_defaults(tmp_path: Path) -> None:
    config = _configure(["--eval-config", str(_yaml(tmp_path, MULTI_TASK)), "--eval-interval", "5",
                         "--eval-top-p", "0.9"])
    assert config.eval.sets == {"aime": f"{tmp_path}/aime.jsonl", "gpqa": f"{tmp_path}/gpqa.jsonl"}
    aime, gpqa = config.for_eval_set("aime"), config.for_eval_set("gpqa")
    assert (aime.eval.n_samples_per_eval_prompt, aime.reward.rm_type, aime.eval_record_keys) == (
        16, "deepscaler", ("question", "answer"))
    assert (gpqa.eval.n_samples_per_eval_prompt, gpqa.reward.rm_type, gpqa.eval.eval_max_response_len) == (
        2, "gpqa", 8)
    assert aime.eval.eval_top_p == gpqa.eval.eval_top_p == 0.7 and aime.eval.eval_max_response_len == 16
    assert config.eval.eval_top_p == 0.9 and config.reward.rm_type != "gpqa"  # the run's own stay the run's
    assert config.for_eval_set(None) is config and config.for_eval_set("aime") is aime


@pytest.mark.unit
@pytest.mark.parametrize(("entry", "why"), [
    ("repetition_penalty: 1.1", "repetition_penalty cannot be set per eval set: no engine here applies"),
    ("temprature: 0.5", "unknown key 'temprature'"),
    ("metadata_overrides: {rm_type: math}", "metadata_overrides is not available"),
])
def test_an_eval_config_key_that_cannot_be_honoured_is_refused_with_its_dataset(tmp_path: Path, entry: str,
                                                                                 why: str) -> None:
    text = MULTI_TASK.replace("      rm_type: gpqa\n", f"      {entry}\n")
    with pytest.raises(ValueError, match=why):
        _configure(["--eval-config", str(_yaml(tmp_path, text)), "--eval-interval", "5"])


@pytest.mark.unit
def test_a_datasets_reward_that_does_not_exist_fails_the_preflight_with_its_set(tmp_path: Path) -> None:
    """slime's example scores its third set with ifbench, a reward not built here: the problem says why."""
    from actors.config.preflight import preflight

    text = MULTI_TASK.replace("rm_type: gpqa", "rm_type: ifbench")
    config = _configure(["--eval-config", str(_yaml(tmp_path, text)), "--eval-interval", "5"])
    problems = preflight(config, {"reward": 1})
    assert any(problem.startswith("eval set 'gpqa': --rm-type ifbench: reward function 'ifbench' is not built "
                                  "here: slime's instruction-following reward runs allenai/IFBench's checkers")
               and "--custom-rm-path" in problem for problem in problems), problems


@pytest.mark.unit
def test_an_eval_groups_sampling_is_its_sets(tmp_path: Path, tiny_model_path: Path) -> None:
    """The rollout worker samples an eval group by its set's view: the set's top-p, length and minimum length
    (capped by what the context leaves), a training group by the run's settings."""
    from transformers import AutoTokenizer

    from engines.inference import TorchEngine

    config = _configure(["--eval-config", str(_yaml(tmp_path, MULTI_TASK)), "--eval-interval", "5",
                         "--hf-checkpoint", str(tiny_model_path), "--rollout-top-p", "0.95"])

    async def params() -> list:
        async with TorchEngine.from_pretrained(tiny_model_path) as engine:
            context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
                                     config=config, worker_id="w")
            groups = [PromptGroup(group_id="g", prompt="p", is_eval=True, eval_set="gpqa", n_samples=2),
                      PromptGroup(group_id="h", prompt="p", n_samples=4)]
            return [context.sampling_params(group) for group in groups]

    gpqa, training = asyncio.run(params())
    assert (gpqa.top_p, gpqa.max_new_tokens, gpqa.min_new_tokens, gpqa.temperature) == (1.0, 8, 3, 0.0)  # greedy
    assert (training.top_p, training.min_new_tokens) == (0.95, 0)


@pytest.mark.unit
def test_a_minimum_eval_length_takes_the_dynamic_kv_cache_and_is_refused_on_the_static_one() -> None:
    import torch

    gpu = torch.device("cuda")
    assert torch_kv_cache(build_config({"eval_prompt_data": ["a", "a.jsonl"], "eval_interval": 1}), gpu) == "static"
    wanted = {"eval_prompt_data": ["a", "a.jsonl"], "eval_interval": 1, "eval_min_new_tokens": 4}
    assert torch_kv_cache(build_config(wanted), gpu) == "dynamic"
    with pytest.raises(SettingsError, match=r"eval_min_new_tokens .*static KV cache holds back no tokens"):
        build_config({**wanted, "torch_kv_cache": "static"})


@pytest.mark.unit
def test_settings_for_a_set_the_run_does_not_evaluate_are_refused() -> None:
    with pytest.raises(SettingsError, match="eval set 'aim' has settings but is not an eval set of this run"):
        build_config({"eval_prompt_data": ["aime", "a.jsonl"], "eval_interval": 1,
                      "eval_set_settings": {"aim": {"eval_top_p": 0.5}}})
