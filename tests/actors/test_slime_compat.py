"""slime plugin compatibility: signature detection, Sample conversion, and the reward/filter/generate adapters."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from actors.config import RunConfig
from actors.config.flags import build_config
from actors.extensions.load import group_filter
from actors.rollout.choice import choose_generate_function
from actors.rollout.generate import default_generate
from actors.slime_compat import DynamicFilterOutput, Sample, build_args, is_slime_style
from actors.slime_compat.plugins import _samples_of, adapt_reward
from actors.slime_compat.sample import from_group, from_wire, to_wire, to_wire_episode
from bus.episodes import group_problem
from bus.schema import PromptGroup, ScoredGroup
from bus.schema import Sample as WireSample
from examples.slime_style import group_rm
from examples.slime_style.retool_generate import run_python

REPO = Path(__file__).resolve().parents[2]
GROUP = PromptGroup(group_id="g1", prompt="2+3=", label="5", n_samples=2, data_index=7)


async def slime_generate(args, sample, sampling_params):
    return sample


async def our_generate(context, group):
    return []


async def half_raising_generate(args, sample, sampling_params):
    """A plugin with a bug on every other response: its first fails, its second answers."""
    if sample.index == 0:
        raise KeyError("reward_model")
    sample.tokens, sample.response, sample.response_length, sample.status = [1, 2, 3], "5", 1, Sample.Status.COMPLETED
    return sample


def slime_filter(args, samples, **kwargs):
    rewards = [s.reward for s in samples]
    return DynamicFilterOutput(keep=len(set(rewards)) > 1, reason="same_reward")


@pytest.mark.unit
def test_signatures_are_told_apart() -> None:
    assert is_slime_style(slime_generate, 3)
    assert not is_slime_style(our_generate, 3)
    assert is_slime_style(group_rm.rm, 2)
    assert not is_slime_style(lambda inp: 1.0, 2)


@pytest.mark.unit
def test_a_slime_sample_built_with_tool_turns_reaches_the_wire_intact() -> None:
    sample = from_group(GROUP, 1)
    sample.tokens = [5, 6, 7]
    spans = [{"version": "3", "start": 0, "end": 2}]
    sample.append_response_tokens(None, tokens=[10, 11], log_probs=[-0.5, -0.25], trainable=True,
                                  meta_info={"finish_reason": {"type": "stop"}, "weight_versions": spans,
                                             "weight_version": "3"}, text="ab")
    sample.append_response_tokens(None, tokens=[12, 13, 14], trainable=False, text="out")
    sample.append_response_tokens(None, tokens=[15], log_probs=[-1.0], trainable=True, text="c")
    wire = to_wire(sample, GROUP, 1, start_version=2)
    assert wire.prompt_tokens == 3 and wire.tokens.tolist() == [5, 6, 7, 10, 11, 12, 13, 14, 15]
    assert wire.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert wire.rollout_log_probs.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    # Per-token spans are kept; tokens without a recorded version take the version at the call's start.
    assert wire.token_versions.tolist() == [3, 3, 2, 2, 2, 2]
    assert wire.status == "completed" and wire.response == "aboutc" and wire.sample_id == "g1/1"
    back = from_wire(wire)
    assert back.tokens == wire.tokens.tolist() and back.loss_mask == [1, 1, 0, 0, 0, 1]
    assert back.status is Sample.Status.COMPLETED and back.label == "5"


@pytest.mark.unit
def test_attributes_a_generate_sets_reach_the_reward_across_the_wire_when_they_are_data() -> None:
    """slime's retool generate counts `sample.tool_call_count` and its reward reads it; here the two run in
    different actors, so plain-data attributes travel with the sample (a client object stays behind)."""
    from bus.codec import decode, encode

    sample = Sample(tokens=[1, 2, 3], response_length=1, response="x")
    sample.tool_call_count, sample.payload = 3, {"turns": [1, 2], "system": True}
    sample.client = object()
    back = from_wire(decode(encode(to_wire(sample, GROUP, 0, start_version=0))))
    assert (back.tool_call_count, back.payload) == (3, {"turns": [1, 2], "system": True})
    assert not hasattr(back, "client") and "slime_attributes" not in back.metadata
    assert not hasattr(from_wire(to_wire(Sample(tokens=[1], response_length=1), GROUP, 0, start_version=0)),
                       "tool_call_count")


@pytest.mark.unit
def test_a_hand_built_sample_without_versions_gets_the_start_version_and_removed_samples_train_nothing() -> None:
    sample = Sample(tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-1.0, -2.0], remove_sample=True,
                    status=Sample.Status.TRUNCATED)
    wire = to_wire(sample, GROUP, 0, start_version=4)
    assert wire.token_versions.tolist() == [4, 4] and wire.loss_mask.tolist() == [0, 0]
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        to_wire(Sample(tokens=[1, 2], response_length=2, loss_mask=[1]), GROUP, 0, start_version=0)


@pytest.mark.unit
def test_a_multi_agent_calls_samples_are_one_episode_of_segments_a_group_counts_once() -> None:
    """slime's multi-agent generate returns a list per call (a sample per agent call): here each list is the
    episode of its response, a segment per sample in the order returned, the last one ending it."""
    def agent_call(index: int, agent: int) -> Sample:
        return Sample(index=index, tokens=[1, 2, 3 + agent, 9], response_length=1, rollout_log_probs=[-0.5],
                      status=Sample.Status.COMPLETED)

    wire = [s for index in range(2) for s in to_wire_episode(
        _samples_of([agent_call(index, agent) for agent in range(3)], "multi_agent"), GROUP, index, start_version=0)]
    assert [s.sample_id for s in wire] == ["g1/0", "g1/0.1", "g1/0.2", "g1/1", "g1/1.1", "g1/1.2"]
    assert [(s.segment, s.parent_segment, s.segments, s.ends_episode) for s in wire[:3]] == [
        (0, None, 3, False), (1, 0, 3, False), (2, 1, 3, True)]
    assert group_problem(wire, GROUP.n_samples) is None
    one = to_wire_episode(_samples_of(agent_call(0, 0), "single"), GROUP, 0, start_version=0)
    assert len(one) == 1 and one[0].segments == 1 and one[0].sample_id == "g1/0"
    with pytest.raises(TypeError, match="multi_agent returned a list holding dict"):
        _samples_of([agent_call(0, 0), {"tokens": []}], "multi_agent")
    with pytest.raises(TypeError, match="multi_agent returned an empty list"):
        _samples_of([], "multi_agent")


@pytest.mark.unit
def test_args_namespace_has_slime_names_and_points_at_the_workers_server() -> None:
    config = build_config({"n_samples_per_prompt": 3, "rollout_max_response_len": 40, "micro_batch_tokens": 9216})
    args = build_args(config, server_url="http://127.0.0.1:31000")
    assert (args.sglang_router_ip, args.sglang_router_port) == ("127.0.0.1", 31000)
    assert args.n_samples_per_prompt == 3 and args.rollout_max_response_len == 40 and args.rollout_top_k == -1
    # retool's generate caps its context at these two when --rollout-max-context-len is not given
    assert (args.context_parallel_size, args.max_tokens_per_gpu, args.rollout_max_context_len) == (1, 9216, None)
    assert args.partial_rollout is False
    # --rollout-num-gpus unset: one engine's GPUs (the engine the args point at), as a client sizing its connection
    # pool slime's way reads them (strands-sglang: sglang_server_concurrency * rollout_num_gpus // per engine)
    assert (args.rollout_num_gpus, args.rollout_num_gpus_per_engine) == (1, 1)
    assert build_args(build_config({"rollout_num_gpus": 8, "rollout_num_gpus_per_engine": 2})).rollout_num_gpus == 8


@pytest.mark.unit
def test_batched_group_rm_scores_wire_samples() -> None:
    config = build_config({"group_rm": True})
    samples = [WireSample(sample_id=f"g/{i}", group_id="g", index=i, prompt="2+3=", label="5", response=text)
               for i, text in enumerate(["5", "5", "4"])]
    reward = adapt_reward(group_rm.rm, config, group=True)
    assert asyncio.run(reward(samples)) == [0.75, 0.75, 0.0]


@pytest.mark.unit
def test_slime_filter_drops_a_group_with_its_reason() -> None:
    config = build_config({})
    filter_group = group_filter(f"{__name__}:slime_filter", config)
    same = [WireSample(sample_id=f"g/{i}", group_id="g", index=i, prompt="p", reward=1.0) for i in range(2)]
    mixed = [WireSample(sample_id="g/0", group_id="g", index=0, prompt="p", reward=1.0),
             WireSample(sample_id="g/1", group_id="g", index=1, prompt="p", reward=0.0)]
    assert filter_group(ScoredGroup(lease_id="l", group_id="g", samples=same, worker_id="w")) == "same_reward"
    assert filter_group(ScoredGroup(lease_id="l", group_id="g", samples=mixed, worker_id="w")) is None


@pytest.mark.unit
def test_slime_generate_is_refused_on_the_embedded_torch_engine() -> None:
    config = build_config({"custom_generate_function_path": f"{__name__}:slime_generate", "rollout_engine": "torch"})
    with pytest.raises(ValueError, match="--rollout-engine sglang"):
        choose_generate_function(config)
    config = build_config({"custom_generate_function_path": f"{__name__}:slime_generate", "rollout_engine": "sglang"})
    assert choose_generate_function(config) is not slime_generate
    assert choose_generate_function(build_config({"custom_generate_function_path": f"{__name__}:our_generate"})) \
        is our_generate
    assert choose_generate_function(build_config({})) is default_generate


@pytest.mark.integration
def test_a_slime_generate_that_raises_fails_that_response_naming_it_and_the_group_comes_back() -> None:
    """The plugin's exception used to end the group's rollout: the group was given out again, failed again, a lease
    timeout each time, for as long as the run lasted."""
    from actors.rollout.generate import RolloutContext
    from engines.sglang.client import SglangEngine

    path = f"{__name__}:half_raising_generate"
    config = build_config({"custom_generate_function_path": path, "rollout_engine": "sglang"})

    async def generate() -> list[WireSample]:
        engine = SglangEngine("http://127.0.0.1:9")  # the plugin never reaches it
        try:
            context = RolloutContext(engine=engine, tokenizer=None, config=config, worker_id="rollout-0-0")
            return await choose_generate_function(config)(context, GROUP)
        finally:
            await engine.close()

    failed, answered = asyncio.run(generate())
    assert (failed.status, failed.error, failed.index) == ("failed", f"{path} raised KeyError('reward_model')", 0)
    assert (answered.status, answered.response, answered.index) == ("completed", "5", 1)


@pytest.mark.integration
def test_retool_sandbox_runs_code_and_times_out() -> None:
    assert asyncio.run(run_python("print(6 * 7)")) == "42"
    assert asyncio.run(run_python("while True: pass", timeout_s=0.5)) == "timeout"


@pytest.mark.integration
def test_a_program_that_ends_as_its_deadline_passes_is_a_timeout_not_an_error() -> None:
    """The event loop blocked past both the program's end and the deadline (a loaded machine) sees the two at
    once; the timeout path must not try to kill a process asyncio already reaped."""

    async def block_the_loop() -> None:
        while not any(Path(task, "children").read_text().split() for task in Path("/proc/self/task").iterdir()):
            await asyncio.sleep(0.005)  # the program has started
        for _ in range(50):  # run_python reaches its deadline wait, many times over
            await asyncio.sleep(0)
        time.sleep(1.0)

    async def both() -> list[str | None]:
        return await asyncio.gather(run_python("pass", timeout_s=0.3), block_the_loop())

    assert asyncio.run(both())[0] in ("timeout", "")


@pytest.mark.unit
def test_each_reward_function_is_given_what_its_loader_says_it_reads() -> None:
    """The reward role calls every function one way: a slime rm reads the wire sample (its adapter converts it),
    ours a RewardInput."""
    from actors.extensions.load import reward_spec
    from policies.rewards import RewardInput

    sample = WireSample(sample_id="g/0", group_id="g", index=0, prompt="2+3=", label="5", response="5")
    ours = reward_spec(build_config({"rm_type": "exact_match"}))
    slimes = reward_spec(build_config({"custom_rm_path": "examples.slime_style.group_rm:rm", "group_rm": True}))
    assert isinstance(ours.argument_of(sample, [sample]), RewardInput)
    assert ours.argument_of(sample, [sample]).response == "5"
    assert slimes.argument_of(sample, [sample]) is sample


@pytest.mark.unit
def test_wire_arrays_keep_their_dtypes() -> None:
    wire = to_wire(Sample(tokens=[1, 2, 3], response_length=1, rollout_log_probs=[-0.1]), GROUP, 0, start_version=0)
    assert wire.tokens.dtype == np.int32 and wire.token_versions.dtype == np.int32


@pytest.mark.unit
def test_slime_custom_loss_gives_slimes_scaled_loss_and_gradient() -> None:
    import torch

    from actors.extensions.load import policy_loss
    from policies.losses import compute_policy_loss

    run = build_config({"loss_type": "examples.slime_style.custom_loss:reinforce_loss",
                        "off_policy_correction": "none"})
    config = run.policy
    lengths = torch.tensor([3, 2])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    log_probs = torch.tensor([-1.0, -2.0, -0.5, -0.3, -0.7], requires_grad=True)
    advantages = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5])
    loss, _ = compute_policy_loss(config, log_probs=log_probs, old_log_probs=log_probs.detach(),
                                  rollout_log_probs=None, advantages=advantages, loss_mask=mask,
                                  response_lengths=lengths, denominator=2.0, loss_fn=policy_loss(run))
    loss.backward()
    # slime's default (per-sample token means, summed, over the step's samples): weight 1 at pi_old.
    expected = -((-1.0 - 0.5) / 2 * 1.0 + (-0.3 - 0.7) / 2 * -0.5) / 2
    assert float(loss.detach()) == pytest.approx(expected)
    assert log_probs.grad.tolist() == pytest.approx([-0.25, 0.0, -0.25, 0.125, 0.125])


@pytest.mark.unit
@pytest.mark.parametrize("spelling", [":", "."], ids=["module:attr", "slime's module.attr"])
def test_slime_pg_loss_reducer_replaces_the_pg_terms_reduction_only(spelling: str) -> None:
    """Dr.GRPO's reducer (each sample's token sum over a constant) as slime's loss divides it: over the step's
    samples; the KL term keeps --loss-agg-mode's per-sample token means."""
    import torch

    from actors.extensions.load import pg_loss_reducer
    from examples.slime_style.custom_loss import DR_GRPO_CONSTANT
    from policies.losses import compute_policy_loss

    path = "examples.slime_style.custom_loss" + spelling + "dr_grpo_reducer"
    run = build_config({"off_policy_correction": "none", "use_kl_loss": True, "kl_loss_coef": 1.0,
                        "kl_loss_type": "k1", "custom_pg_loss_reducer_function_path": path})
    lengths = torch.tensor([3, 2])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    log_probs = torch.tensor([-1.0, -2.0, -0.5, -0.3, -0.7], requires_grad=True)
    advantages = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5])
    ref = torch.tensor([-1.5, -2.0, -0.5, -0.3, -0.2])

    def loss_of(reducer):
        value, metrics = compute_policy_loss(
            run.policy, log_probs=log_probs, old_log_probs=log_probs.detach(), rollout_log_probs=None,
            advantages=advantages, loss_mask=mask, response_lengths=lengths, ref_log_probs=ref, denominator=2.0,
            pg_reducer=reducer)
        return value, metrics

    loss, metrics = loss_of(pg_loss_reducer(run))
    # ppo at ratio 1: per-token pg loss -A; Dr.GRPO sums each sample's tokens over the constant
    pg = -((1.0 + 1.0) + (-0.5 - 0.5)) / DR_GRPO_CONSTANT / 2
    kl = ((0.5 + 0.0) / 2 + (0.0 - 0.5) / 2) / 2  # k1 = log pi - log ref, per-sample token means (the mode's)
    assert metrics["pg_loss"] == pytest.approx(pg)
    assert metrics["kl_loss"] == pytest.approx(kl) and float(loss.detach()) == pytest.approx(pg + kl)
    _, default_metrics = loss_of(None)
    assert default_metrics["pg_loss"] == pytest.approx(-((1.0 + 1.0) / 2 + (-0.5 - 0.5) / 2) / 2)
    assert default_metrics["kl_loss"] == pytest.approx(kl)


@pytest.mark.unit
def test_a_pg_loss_reducer_that_returns_no_scalar_is_named() -> None:
    import torch

    from actors.slime_compat.pg_reducer import SlimePgReducer

    reducer = SlimePgReducer(factory=lambda *args: (lambda x: x), path="my:reducer", per_token=False)
    with pytest.raises(ValueError, match=r"--custom-pg-loss-reducer-function-path 'my:reducer': the reducer "
                                         r"returned \(3,\), expected a scalar tensor"):
        reducer(torch.ones(3), torch.ones(3), torch.tensor([3]))
    not_a_factory = SlimePgReducer(factory=lambda *args: 1.0, path="my:reducer", per_token=False)
    with pytest.raises(TypeError, match="returned float, expected the reducer"):
        not_a_factory(torch.ones(3), torch.ones(3), torch.tensor([3]))


@pytest.mark.unit
def test_a_loss_of_ours_loads_as_it_is_and_only_slimes_is_converted() -> None:
    from actors.extensions.load import policy_loss
    from policies.losses import ppo_loss

    assert policy_loss(build_config({"loss_type": "policies.losses:ppo_loss"})) is ppo_loss
    assert policy_loss(build_config({})) is ppo_loss  # the default estimator's registered loss
    slime_loss = policy_loss(build_config({"loss_type": "examples.slime_style.custom_loss:reinforce_loss"}))
    assert slime_loss.__name__ == "reinforce_loss" and slime_loss.__module__ == "actors.slime_compat.losses"



@pytest.mark.unit
def test_run_keeps_one_background_loop_so_http_sessions_are_reused() -> None:
    """slime's `run(coro)`: a ported sync rollout function calls it per batch; one loop means one HTTP session."""
    from actors.slime_compat import run
    from actors.slime_compat.http import _session

    async def loop_and_session() -> tuple[object, object]:
        return asyncio.get_running_loop(), _session()

    first_loop, first_session = run(loop_and_session())
    second_loop, second_session = run(loop_and_session())
    assert first_loop is second_loop and first_session is second_session
    assert run(asyncio.sleep(0, result=42)) == 42


@pytest.fixture
def slime_modules() -> Iterator[None]:
    """The `slime*` modules imported so far, put back as they were after the test (which may import others)."""
    before = {name: module for name, module in sys.modules.items() if name == "slime" or name.startswith("slime.")}
    yield
    for name in [name for name in sys.modules if name == "slime" or name.startswith("slime.")]:
        del sys.modules[name]
    sys.modules.update(before)


async def generate_over_http(config: RunConfig, url: str) -> list[WireSample]:
    """GROUP's samples from the config's generate function, as a rollout worker whose engine serves `url` makes
    them."""
    from actors.rollout.generate import RolloutContext
    from actors.slime_compat.http import close_session
    from engines.sglang.client import SglangEngine

    engine = SglangEngine(url)
    try:
        context = RolloutContext(engine=engine, tokenizer=None, config=config, worker_id="rollout-0-0")
        return await choose_generate_function(config)(context, GROUP)
    finally:
        await close_session()
        await engine.close()


@pytest.mark.integration
def test_a_plugin_written_with_slimes_imports_loads_through_our_loader_and_runs(slime_modules: None) -> None:
    """slime's example plugins import slime's modules: with no slime installed they get ours, unchanged. Here each
    agent call reaches the engine with `post`, and `batched_async_rm` scores the agents' answers by --rm-type."""
    from aiohttp import web

    from tests.support import slime_imports_plugin as plugin
    from tests.support.http_apps import served

    async def generate_route(request: web.Request) -> web.Response:
        assert (await request.json())["input_ids"] == plugin.PROMPT_TOKENS
        return web.json_response({"text": "5", "meta_info": {"output_token_logprobs": [[-0.25, 20, None]],
                                                             "finish_reason": {"type": "stop"}}})

    app = web.Application()
    app.router.add_post("/generate", generate_route)
    config = build_config({"custom_generate_function_path": f"{plugin.__name__}.generate_with_multi_agents",
                           "rollout_engine": "sglang", "rm_type": "exact_match"})
    plugin.Calls.clear_instances()

    with served(app) as url:
        samples = asyncio.run(generate_over_http(config, url))
    assert sys.modules["slime.utils.types"].Sample is Sample
    assert plugin.Calls().count == GROUP.n_samples
    assert len(samples) == GROUP.n_samples * plugin.AGENTS  # each response an episode of one segment per agent
    for sample in samples:
        assert (sample.status, sample.response, sample.reward) == ("completed", "5", 1.0)
        assert sample.tokens.tolist() == [*plugin.PROMPT_TOKENS, 20]
        assert sample.rollout_log_probs.tolist() == [-0.25]


@pytest.mark.integration
def test_a_strands_agent_generates_through_the_stand_in_sglang_server(tiny_model_path: Path, tmp_path: Path,
                                                                      slime_modules: None) -> None:
    """slime's strands example: a Strands agent over strands-sglang's SGLangModel, which calls /generate with token
    ids and reads SGLang's meta_info (cached_tokens, e2e_latency ...). Against the stand-in server its trajectory
    reaches the wire with one log-prob and one mask entry per response token."""
    pytest.importorskip("strands_sglang", reason="the strands extra (pip install -e .[strands])")
    from engines.sglang.launch import ServerProcess, ServerSpec
    from tests.support import strands_generate as plugin

    config = build_config({"custom_generate_function_path": f"{plugin.__name__}.generate", "rollout_engine": "sglang",
                           "hf_checkpoint": str(tiny_model_path), "rollout_max_response_len": 6,
                           "rm_type": "exact_match"})
    server = ServerProcess(ServerSpec(model_path=str(tiny_model_path), module="tools.standins.sglang_server",
                                      random_seed=3, extra={"torch-threads": "1"}),
                           startup_timeout=120, log_dir=tmp_path)

    server.start()
    try:
        samples = asyncio.run(generate_over_http(config, server.url))
        # a later turn's request (logprob_start_len: the last token the agent already has): the log-probs of the
        # tokens it appended (tool results) come back in input_token_logprobs; the first entry, the token it had,
        # is None here as the stand-in's scoring path gives it, and the agent reads only the entries after it
        body = json.dumps({"input_ids": [5, 6, 7, 8], "return_logprob": True, "logprob_start_len": 2,
                           "sampling_params": {"max_new_tokens": 2}}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{server.url}/generate", data=body), timeout=60) as reply:
            meta = json.load(reply)["meta_info"]
    finally:
        server.stop()
    assert [entry[1] for entry in meta["input_token_logprobs"]] == [7, 8]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_token_logprobs"][1][0] <= 0.0
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] >= 1
    assert len(samples) == GROUP.n_samples
    for sample in samples:
        assert sample.status in ("completed", "truncated"), sample.error
        assert 1 <= sample.response_length <= 6  # one model turn (a random model calls no tool) of at most 6 tokens
        assert len(sample.tokens) == sample.prompt_tokens + sample.response_length
        assert sample.loss_mask.tolist() == [1] * sample.response_length
        assert len(sample.rollout_log_probs) == sample.response_length
        assert np.all(sample.rollout_log_probs <= 0.0)  # the engine's log-probs, every one a number


def batch_rm(args, samples):
    """A slime-style batched rm (`--custom-rm-path` with slime's batched_async_rm): one call, the whole list."""
    return [float(sample.response == sample.label) for sample in samples]


def raising_reward(inp):
    raise ValueError("no label")


@pytest.mark.unit
def test_batched_async_rm_chooses_the_reward_as_slime_does_and_names_a_failed_one() -> None:
    from types import SimpleNamespace

    from actors.slime_compat.rm_hub import batched_async_rm

    samples = [Sample(index=0, prompt="2+3=", response="5", label="5"),
               Sample(index=1, prompt="2+3=", response="so \\boxed{5}", label="5", metadata={"rm_type": "boxed_f1"})]
    slime_rm = SimpleNamespace(custom_rm_path=f"{__name__}.batch_rm", rm_type="exact_match")
    assert asyncio.run(batched_async_rm(slime_rm, samples)) == [1.0, 0.0]
    by_type = SimpleNamespace(custom_rm_path=None, rm_type="exact_match")  # the second sample's own type wins
    assert asyncio.run(batched_async_rm(by_type, samples)) == [1.0, 1.0]
    ours = SimpleNamespace(custom_rm_path=f"{__name__}:raising_reward", rm_type=None)
    with pytest.raises(RuntimeError, match=r"failed for sample\(s\) 0: raised ValueError: no label; 1: raised"):
        asyncio.run(batched_async_rm(ours, samples))


@pytest.mark.unit
def test_a_slime_module_not_offered_fails_naming_it_and_what_is_offered(slime_modules: None) -> None:
    with pytest.raises(ModuleNotFoundError) as error:
        importlib.import_module("slime.nonexistent")
    assert error.value.name == "slime.nonexistent"
    assert "No module named 'slime.nonexistent' here" in str(error.value)
    assert "slime.utils.types, slime.utils.http_utils" in str(error.value) and "docs/slime.md" in str(error.value)
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'slime\.agent' here: .*E2B"):
        importlib.import_module("slime.agent.sandbox")
    with pytest.raises(ImportError, match=r"slime.utils.misc.exec_command is not offered here \(it has "
                                          r"SingletonMeta, load_function"):
        from slime.utils.misc import exec_command  # noqa: F401
    from slime.rollout.rm_hub import batched_async_rm
    from slime.utils.misc import load_function

    assert load_function("slime.rollout.rm_hub.batched_async_rm") is batched_async_rm


@pytest.mark.unit
def test_a_package_slimes_examples_import_that_is_not_installed_says_how_to_get_it() -> None:
    """tau-bench is on no package index: its import names the fork slime installs and the hosted user model."""
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'tau_bench': .*not on PyPI.*JD-ETH/tau-bench"
                                                  r".*hosted LLM") as error:
        importlib.import_module("tau_bench.envs")
    assert error.value.name == "tau_bench"
    assert importlib.util.find_spec("not_a_package_anywhere") is None  # any other name: Python's own answer


@pytest.mark.unit
def test_slimes_dapo_scorer_is_answered_under_its_name_and_parameters(slime_modules: None) -> None:
    """slime's retool example imports `compute_score` from `math_dapo_utils` and calls it with
    `strict_box_verify=True` on prompt + response: slime's dict comes back (`policies.rewards.dapo` is tested)."""
    from slime.rollout.rm_hub.math_dapo_utils import compute_score, normalize_final_answer

    transcript = "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n6 * 7 = 42, so \\boxed{42}"
    assert compute_score(transcript, "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score(transcript, "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert compute_score(transcript + "\nAnswer: $42$", "42", False, None)["acc"]
    assert normalize_final_answer("x = 1,000 dollars") == "1000"


@pytest.mark.unit
def test_the_shim_steps_aside_for_an_installed_slime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     slime_modules: None) -> None:
    """A slime on the path (installed, or its checkout) is imported as itself, its missing modules failing as
    Python fails them: the shim answers only where there is no slime."""
    (tmp_path / "slime").mkdir()
    (tmp_path / "slime" / "__init__.py").write_text("INSTALLED = True\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [name for name in sys.modules if name == "slime" or name.startswith("slime.")]:
        del sys.modules[name]
    import slime

    assert slime.INSTALLED
    with pytest.raises(ModuleNotFoundError) as error:
        importlib.import_module("slime.utils.types")
    assert str(error.value) == "No module named 'slime.utils'"


@pytest.mark.integration
def test_slimes_examples_join_ours_so_its_plugin_paths_resolve(tmp_path: Path) -> None:
    """slime's plugins are `examples.<example>.<module>` of its checkout (its root on PYTHONPATH): our `examples`
    package takes in every `examples` folder on the path, ours first."""
    (tmp_path / "examples" / "multi_agent").mkdir(parents=True)
    (tmp_path / "examples" / "__init__.py").write_text("raise ImportError('slime checkout first')\n", encoding="utf-8")
    (tmp_path / "examples" / "multi_agent" / "mod.py").write_text("from slime.utils.types import Sample\n",
                                                                  encoding="utf-8")
    code = ("import actors, examples.multi_agent.mod as theirs, examples.slime_style as ours\n"
            "print(theirs.__file__, ours.__file__, theirs.Sample.__module__)")
    shown = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == [str(tmp_path / "examples" / "multi_agent" / "mod.py"),
                                    str(REPO / "examples" / "slime_style" / "__init__.py"),
                                    "actors.slime_compat.sample"]
