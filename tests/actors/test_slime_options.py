"""slime's sampling, length and reward-key options, honoured with slime's meaning (issue #14).

Eval sampling (--eval-top-p/-top-k/-max-response-len), stop token ids, the response text's special tokens,
prompt-length filters at load time, the prompt + response context cap, chat-template keyword arguments, and
--reward-key / --eval-reward-key picking the scalar out of a dict reward.
"""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path
from typing import Any

import pytest

from actors.config import config_from_args, split_sglang_args
from actors.config.run import RunConfig
from actors.data.prompt_tokens import encode_prompt, prompt_length_counter
from actors.data.prompts import DatasetError, load_prompts
from actors.rollout.generate import NoRoomError, RolloutContext, default_generate
from bus.schema import PromptGroup
from launcher import build_parser
from policies.rewards import score, score_group
from policies.rewards.runner import outcome_from_value
from tools.standins.tiny_model import build_tokenizer


def configure(argv: list[str]) -> RunConfig:
    rest, passthrough = split_sglang_args(argv)
    args = build_parser().parse_args(["--head", *rest])
    args.sglang_passthrough = passthrough
    return config_from_args(args)


def context(config: RunConfig, tokenizer: Any = None) -> RolloutContext:
    # engine=None: these paths never reach the engine (sampling parameters, or a prompt that leaves no room).
    return RolloutContext(engine=None, tokenizer=tokenizer or build_tokenizer(),  # type: ignore[arg-type]
                          config=config, worker_id="rollout-0")


@pytest.mark.unit
def test_slime_command_line_sets_the_options() -> None:
    config = configure(["--eval-top-p", "0.5", "--eval-top-k", "-1", "--eval-max-response-len", "7",
                        "--rollout-stop-token-ids", "5", "9", "--no-rollout-skip-special-tokens",
                        "--rollout-max-context-len", "100", "--rollout-max-prompt-len", "60",
                        "--eval-max-context-len", "50", "--eval-max-prompt-len", "40", "--reward-key", "acc",
                        "--eval-reward-key", "pass", "--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    assert (config.eval.eval_top_p, config.eval.eval_top_k, config.eval.eval_max_response_len) == (0.5, 0, 7)
    assert config.rollout.rollout_stop_token_ids == [5, 9]
    assert config.rollout.rollout_skip_special_tokens is False
    assert (config.rollout.rollout_max_context_len, config.data.rollout_max_prompt_len) == (100, 60)
    assert (config.eval.eval_max_context_len, config.eval.eval_max_prompt_len) == (50, 40)
    assert (config.reward.reward_key, config.eval.eval_reward_key) == ("acc", "pass")
    assert config.data.apply_chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.unit
def test_bad_option_values_are_named() -> None:
    with pytest.raises(ValueError, match=r"rollout_max_prompt_len 100 must be at most rollout_max_context_len - 1"):
        configure(["--rollout-max-context-len", "100", "--rollout-max-prompt-len", "100"])
    with pytest.raises(ValueError, match=r"eval_max_prompt_len 60 must be at most eval_max_context_len - 1 = 49"):
        configure(["--rollout-max-context-len", "50", "--eval-max-prompt-len", "60"])
    with pytest.raises(ValueError, match=r"--apply-chat-template-kwargs .*not JSON"):
        configure(["--apply-chat-template-kwargs", "{enable_thinking: false"])
    with pytest.raises(ValueError, match=r"--eval-min-new-tokens -1: must be >= 0"):
        configure(["--eval-min-new-tokens", "-1"])


@pytest.mark.unit
def test_eval_groups_sample_with_the_eval_values() -> None:
    config = RunConfig.model_validate({
        "rollout": {"rollout_top_p": 0.9, "rollout_top_k": 20, "rollout_max_response_len": 64,
                    "rollout_stop_token_ids": [7]},
        "eval": {"eval_temperature": 0.6, "eval_top_p": 0.5, "eval_top_k": 4, "eval_max_response_len": 16}})
    ctx = context(config)
    train = ctx.sampling_params(PromptGroup(group_id="g", prompt="x", n_samples=2))
    evaluation = ctx.sampling_params(PromptGroup(group_id="eval:s:0:0", prompt="x", is_eval=True))
    assert (train.top_p, train.top_k, train.max_new_tokens, train.stop_token_ids) == (0.9, 20, 64, (7,))
    assert (evaluation.temperature, evaluation.top_p, evaluation.top_k, evaluation.max_new_tokens) == \
        (0.6, 0.5, 4, 16)
    assert evaluation.stop_token_ids == (7,)


@pytest.mark.unit
def test_context_cap_shrinks_max_new_tokens_and_fails_a_prompt_without_room() -> None:
    config = RunConfig.model_validate({"rollout": {"rollout_max_response_len": 32, "rollout_max_context_len": 40},
                                       "eval": {"eval_max_context_len": 20}})
    ctx = context(config)
    group = PromptGroup(group_id="g", prompt="x", n_samples=3)
    assert ctx.sampling_params(group, prompt_tokens=4).max_new_tokens == 32
    assert ctx.context_cuts == []
    assert ctx.sampling_params(group, prompt_tokens=30).max_new_tokens == 10
    assert ctx.context_cuts == ["a prompt of 30 tokens leaves 10 of 32 new tokens under --rollout-max-context-len 40"]
    eval_group = PromptGroup(group_id="eval:s:0:0", prompt="x", is_eval=True)
    assert ctx.sampling_params(eval_group, prompt_tokens=15).max_new_tokens == 5
    with pytest.raises(NoRoomError, match=r"prompt of 40 tokens leaves no room .* --rollout-max-context-len 40"):
        ctx.sampling_params(group, prompt_tokens=40)
    long_prompt = PromptGroup(group_id="g2", prompt="y" * 60, n_samples=3)
    samples = asyncio.run(default_generate(ctx, long_prompt))  # never reaches the engine
    assert [s.status for s in samples] == ["failed"] * 3
    assert all("--rollout-max-context-len 40" in (s.error or "") and s.response_length == 0 for s in samples)


@pytest.mark.unit
def test_response_text_keeps_or_skips_special_tokens() -> None:
    tokenizer = build_tokenizer()
    ids = [*tokenizer("4", add_special_tokens=False)["input_ids"], tokenizer.convert_tokens_to_ids("<|im_end|>")]
    keep = context(RunConfig.model_validate({"rollout": {"rollout_skip_special_tokens": False}}), tokenizer)
    skip = context(RunConfig(), tokenizer)
    assert keep.decode_response(ids) == "4<|im_end|>"
    assert skip.decode_response(ids) == "4"


@pytest.mark.unit
def test_chat_template_kwargs_reach_the_template() -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}!{% endif %}")
    config = RunConfig.model_validate({"data": {"apply_chat_template": True,
                                                "apply_chat_template_kwargs": '{"enable_thinking": false}'}})
    with_kwargs = context(config, tokenizer).prompt_ids("ab")
    plain = encode_prompt(tokenizer, "ab", chat_template=True)
    assert tokenizer.decode(with_kwargs) == "ab!"
    assert tokenizer.decode(plain) == "ab"
    assert prompt_length_counter(config, tokenizer)("ab") == len(with_kwargs)


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"input": p, "label": "1"}) + "\n" for p in prompts) + "{bad\n",
                    encoding="utf-8")
    return path


@pytest.mark.unit
def test_long_prompts_are_dropped_at_load_and_counted(tmp_path: Path) -> None:
    path = write_prompts(tmp_path / "p.jsonl", ["short", "x" * 50, "mid" * 5, "y" * 30])
    count = prompt_length_counter(RunConfig(), build_tokenizer())
    records, report = load_prompts(path, max_prompt_len=20, count_tokens=count)
    assert [r.prompt for r in records] == ["short", "mid" * 5]
    assert [r.data_index for r in records] == [0, 1]
    assert (report.too_long, len(report.skipped), report.records) == (2, 1, 2)
    assert report.first_too_long == f"line 2 ({count('x' * 50)} tokens)"
    with pytest.raises(DatasetError, match=r"no usable records \(1 malformed, the first at line 5: .*; 4 over 2 "
                                           r"prompt tokens, the first at line 1 \(\d+ tokens\)\)"):
        load_prompts(path, max_prompt_len=2, count_tokens=count)


@pytest.mark.unit
def test_reward_key_picks_the_scalar_and_names_a_missing_key() -> None:
    assert outcome_from_value({"acc": 1.0, "format": 0.5}, key="acc").reward == 1.0
    missing = outcome_from_value({"format": 0.5, "len": 3}, key="acc")
    assert missing.status == "error"
    assert "'acc'" in missing.reason and "['format', 'len']" in missing.reason
    assert outcome_from_value({"reward": 0.25}).reward == 0.25  # no key: our default dict shape

    def scores(inp: Any) -> dict[str, float]:
        return {"acc": 1.0 if inp == "right" else 0.0, "format": 1.0}

    outcomes = asyncio.run(score(scores, ["right", "wrong"], key="acc"))  # type: ignore[list-item]
    assert [o.reward for o in outcomes] == [1.0, 0.0]
    group = asyncio.run(score_group(lambda batch: [scores(i) for i in batch], ["right"], key="format"))
    assert [o.reward for o in group] == [1.0]
    failed = asyncio.run(score(scores, ["right"], key="pass"))  # type: ignore[list-item]
    assert failed[0].status == "error" and "'pass'" in failed[0].reason


class Log:
    """Collects warnings as the actors' structured log would write them."""

    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


@pytest.mark.unit
def test_eval_set_drops_long_prompts_and_says_so(tmp_path: Path) -> None:
    from actors.buffer.core import BufferCore
    from actors.data.prompts import PromptRecord, PromptSource
    from actors.evaluator.rounds import EvalRounds

    eval_set = tmp_path / "aime.jsonl"
    eval_set.write_text("".join(json.dumps({"input": p, "label": "2"}) + "\n" for p in ["1+1=", "z" * 40, "2+2="]))
    config = configure(["--eval-prompt-data", "aime", str(eval_set), "--eval-interval", "1",
                        "--eval-max-prompt-len", "10"])
    core = BufferCore(source=PromptSource([PromptRecord(0, "0+1=", "1", {})], seed=1), n_samples=1,
                      groups_per_batch=1, max_staleness=0, lease_timeout=10.0)
    log = Log()
    rounds = EvalRounds(config, core.guest_queue, writer=None, log=log, tokenizer=build_tokenizer())  # type: ignore[arg-type]
    assert [r.prompt for r in rounds.sets["aime"]] == ["1+1=", "2+2="]
    assert rounds.skipped_long == {"aime": 1}
    assert log.warnings == [("skipped long eval prompts", {"set": "aime", "count": 1, "max_prompt_tokens": 10,
                                                           "first": f"{eval_set} line 2 (40 tokens)", "kept": 2})]


@pytest.mark.unit
def test_a_worker_says_when_the_context_cap_cut_its_responses_short_then_counts_it() -> None:
    """A prompt a token short of the cap used to get one new token, and the run said nothing."""
    from collections import Counter

    from actors.rollout.actor import RolloutWorker

    said: list[tuple[str, str]] = []
    log = types.SimpleNamespace(warning=lambda event, **_: said.append(("warning", event)),
                                info=lambda event, **_: said.append(("info", event)))
    worker = types.SimpleNamespace(counters=Counter(), log=log)
    config = RunConfig.model_validate({"rollout": {"rollout_max_response_len": 32, "rollout_max_context_len": 40}})
    group = PromptGroup(group_id="g", prompt="x", n_samples=1)
    for prompt_tokens in (4, 39, 35):
        ctx = context(config)
        ctx.sampling_params(group, prompt_tokens=prompt_tokens)
        RolloutWorker._note_context_cuts(worker, ctx, group)  # type: ignore[arg-type]
    assert worker.counters["groups.max_new_tokens_cut"] == 2
    assert said == [("warning", "a prompt of 39 tokens leaves 1 of 32 new tokens under --rollout-max-context-len 40: "
                                "its responses may end truncated (later groups cut so are counted as "
                                "groups.max_new_tokens_cut)"),
                    ("info", "a prompt of 35 tokens leaves 5 of 32 new tokens under --rollout-max-context-len 40: "
                             "its responses may end truncated (later groups cut so are counted as "
                             "groups.max_new_tokens_cut)")]
