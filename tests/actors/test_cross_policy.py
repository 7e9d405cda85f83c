"""An episode that calls another policy: what the rollout context gives it (`engine_of`, `group_for`), what an agent
episode's calls naming another policy as `model` become (`AgentCalls`, through the real endpoint and OpenAI client),
and how the worker tells the policies' samples apart (`split_by_policy`). The engine is a real torch engine serving
two named adapters; the episodes are tests/support/cross_policy.py's. And the bound on what a policy adopts: real
actors in process (controller, each policy's buffer, the reward and rollout workers) on real sockets, where the
rollout worker's lane holds back the episodes that feed a policy whose adopted backlog is at its bound."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.buffer.adoption import adopted_waiting
from actors.config import RunConfig
from actors.config.policies import served_elsewhere
from actors.rollout.agent import AgentRunner
from actors.rollout.chat_session import ChatSession
from actors.rollout.cross_policy import AgentCalls, split_by_policy
from actors.rollout.generate import RolloutContext
from actors.rollout.lanes import AdapterEngine
from actors.rollout.openai_endpoint import OpenAIEndpoint
from bus import RpcClient
from bus.schema import Batch, BatchRequest, PromptGroup
from engines.inference import GenerateRequest, TorchEngine
from tests.support.adapters import random_adapter
from tests.support.cross_policy import SUMS_TURN, add_then_sums
from tests.support.inprocess import HANG_S, actor_system, write_prompts
from tests.support.policies import start_actor

pytestmark = pytest.mark.integration
CROSS_POLICY = "tests.support.cross_policy"
ADD_TURNS_ONLY = "tests.support.cross_policy:turns_in_add_episodes_only"
GROUP = PromptGroup(group_id="0:3", prompt="1 + 2 =", label="3", n_samples=2, data_index=3)


def _context(engine: TorchEngine, tokenizer: object, policy: str | None = "add", *, sums_samples: int = 3,
             **settings: Any) -> RolloutContext:
    config = RunConfig(hf_checkpoint="unused", n_samples_per_prompt=2, rollout_max_response_len=6,
                       rollout_temperature=0.0, **settings)
    sums = RunConfig(hf_checkpoint="unused", n_samples_per_prompt=sums_samples, rollout_max_response_len=4,
                     rollout_temperature=0.0, **settings)
    policies = ("add", "sums") if policy is not None else ()
    return RolloutContext(engine=AdapterEngine(engine, "add") if policy else engine, tokenizer=tokenizer,
                          config=config, worker_id="rollout-0-0", policy=policy,
                          policy_engines={name: AdapterEngine(engine, name) for name in policies},
                          policy_configs={"add": config, "sums": sums} if policy else {})


@pytest.fixture
async def engine(tiny_model_path: Path) -> TorchEngine:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    served = TorchEngine(model, None, lora_scaling=2.0)  # type: ignore[arg-type]
    await served.update_weights(random_adapter(model, 4, 1, scale=0.5), 2, adapter="add")
    await served.update_weights(random_adapter(model, 4, 2, scale=0.5), 5, adapter="sums")
    yield served
    await served.close()


async def test_an_episodes_turns_of_another_policy_come_from_its_adapter_and_form_a_group_of_its_own(
        engine: TorchEngine, tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    context = _context(engine, tokenizer)
    samples = await add_then_sums(context, GROUP)
    own, others = split_by_policy(context, GROUP, samples)
    assert [sample.sample_id for sample in own] == ["0:3/0", "0:3/1"]
    assert all(set(sample.token_versions.tolist()) == {2} for sample in own)  # add's adapter, at add's version
    [turns] = others
    assert (turns.policy, turns.group.group_id, turns.group.n_samples) == ("sums", "0:3@sums.echo", 3)
    assert turns.group.metadata == {"host_group": "0:3", "host_policy": "add"} and turns.group.data_index == 3
    assert [sample.sample_id for sample in turns.samples] == [f"0:3@sums.echo/{index}" for index in range(3)]
    assert turns.samples[0].prompt == SUMS_TURN + own[0].response
    # sums' turns are what sums' adapter samples, at sums' version, from the prompt the episode built
    prompt_ids = turns.samples[0].tokens[: turns.samples[0].prompt_tokens].tolist()
    [alone] = await engine.generate(GenerateRequest("alone", prompt_ids, context.sampling_params(turns.group, n=1),
                                                    adapter="sums"))
    assert turns.samples[0].tokens[len(prompt_ids):].tolist() == alone.output_ids
    assert set(turns.samples[0].token_versions.tolist()) == {5}
    # each policy's turns are sampled by its own settings
    assert (context.sampling_params(GROUP).max_new_tokens, context.sampling_params(turns.group).max_new_tokens) == (
        6, 4)
    assert max(sample.response_length for sample in turns.samples) <= 4


async def test_an_episode_is_told_what_it_cannot_do_by_name(engine: TorchEngine, tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    context = _context(engine, tokenizer)
    with pytest.raises(ValueError, match=r"engine_of\('judge'\): no policy 'judge' in this run \(policies: \['add', "
                                         r"'sums'\]\)"):
        context.engine_of("judge")
    elsewhere = dataclasses.replace(context, policies_elsewhere=served_elsewhere(
        {"add": {}, "sums": {}, "solo": {"own_engines": 1}}, ["add", "sums"], own_engine=False))
    with pytest.raises(ValueError, match=r"engine_of\('solo'\): 'solo' is served on engines of its own "
                                         r"\(own_engines\), not on this episode's engine; an episode of 'add' calls "
                                         r"only the policies served beside it: \['add', 'sums'\]"):
        elsewhere.engine_of("solo")
    with pytest.raises(ValueError, match="that is this episode's own policy"):
        context.group_for("add", GROUP, "k", "prompt")
    with pytest.raises(ValueError, match="must be a non-empty name without '/' or '@'"):
        context.group_for("sums", GROUP, "a/b", "prompt")
    context.group_for("sums", GROUP, "k", "prompt")
    with pytest.raises(ValueError, match="key 'k' is used twice in the episode of 0:3"):
        context.group_for("sums", GROUP, "k", "prompt")
    alone = _context(engine, tokenizer, policy=None)
    with pytest.raises(ValueError, match="none: this run has one unnamed policy"):
        alone.engine_of("sums")
    episode = _context(engine, tokenizer)
    samples = await add_then_sums(episode, GROUP)
    stray = msgspec.structs.replace(samples[0], group_id="0:4", sample_id="0:4/0")
    with pytest.raises(ValueError, match=r"neither its group '0:3' nor one it opened .*\['0:4/0'\]"):
        split_by_policy(episode, GROUP, [*samples, stray])


async def test_an_agents_call_naming_another_policy_is_that_policys_turn_in_a_group_of_its_own(
        engine: TorchEngine, tiny_model_path: Path) -> None:
    """add's agent answers, then puts its answer to sums by naming it as the request's model: sums' adapter answers
    at sums' version, in a conversation of sums' own (not in add's trajectory), and the group's two episodes' calls
    to sums make sums' group of two, which the worker tells apart from add's samples."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    context = _context(engine, tokenizer, sums_samples=2, agent_function_path=f"{CROSS_POLICY}:add_asks_sums")
    runner = AgentRunner(context.config)
    await runner.start()
    try:
        samples = await runner(context, GROUP)
        again = await runner(context, GROUP)  # on the same context, as after an abort (`unless_aborted`)
    finally:
        await runner.stop()
    assert [sample.sample_id for sample in again] == [sample.sample_id for sample in samples]
    own, others = split_by_policy(context, GROUP, samples)
    assert [sample.sample_id for sample in own] == ["0:3/0", "0:3/1"]
    assert all(sample.metadata["turns"] == 1 and set(sample.token_versions.tolist()) == {2} for sample in own)
    [turns] = others
    assert (turns.policy, turns.group.group_id, turns.group.n_samples) == ("sums", "0:3@sums.agent", 2)
    assert [sample.sample_id for sample in turns.samples] == ["0:3@sums.agent/0", "0:3@sums.agent/1"]
    for mine, theirs in zip(own, turns.samples, strict=True):
        answer = mine.messages[-1]["content"]
        assert theirs.messages[0] == {"role": "user", "content": SUMS_TURN + answer}
        assert (theirs.prompt, theirs.label, theirs.error) == (GROUP.prompt, GROUP.label, None)
        assert theirs.metadata | {"host_group": "0:3", "host_policy": "add", "asked": answer} == theirs.metadata
        assert set(theirs.token_versions.tolist()) == {5}
        prompt_ids = theirs.tokens[: theirs.prompt_tokens].tolist()
        [alone] = await engine.generate(GenerateRequest("alone", prompt_ids, context.sampling_params(
            turns.group, n=1), adapter="sums"))
        assert theirs.tokens[len(prompt_ids):].tolist() == alone.output_ids  # sums' adapter, greedy
    assert not runner.endpoint.sessions and not runner.endpoint.calls


async def test_an_agent_is_told_by_name_which_policies_it_can_call(engine: TorchEngine, tiny_model_path: Path) -> None:
    """A model the run does not serve is a 404 naming what it serves (a run of one policy serves no other); a policy
    whose groups are not as large as the episode's is a 400 naming both sizes; an episode that never called the
    other policy is a failed sample of that policy's group, saying so."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    served = OpenAIEndpoint(model="tiny")
    await served.start()
    context = _context(engine, tokenizer, sums_samples=2)
    calls = AgentCalls(context, GROUP)
    ask = [{"role": "user", "content": "1 + 2 ="}]
    try:
        url = served.open(ChatSession(context, GROUP, 0), calls)
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            assert [model.id for model in (await client.models.list()).data] == ["tiny", "add", "sums"]
            with pytest.raises(openai.NotFoundError, match=r"model 'judge' is not served here: name a policy of "
                                                           r"this run \['add', 'sums'\]; the episode's own, 'add'"):
                await client.chat.completions.create(model="judge", messages=ask)
            for own in ("tiny", "add"):
                await client.chat.completions.create(model=own, messages=ask, max_tokens=2)
            await client.chat.completions.create(model="sums", messages=ask)
        apart = dataclasses.replace(context, policies_elsewhere={"solo": "on engines of its own (own_engines)"})
        url = served.open(ChatSession(apart, GROUP, 0), AgentCalls(apart, GROUP))
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError, match=r"model 'solo' is not served here: it is served on engines "
                                                           r"of its own \(own_engines\); an episode calls only the "
                                                           r"policies served beside it, \['add', 'sums'\]"):
                await client.chat.completions.create(model="solo", messages=ask)
        mismatched = _context(engine, tokenizer, sums_samples=3)
        url = served.open(ChatSession(mismatched, GROUP, 0), AgentCalls(mismatched, GROUP))
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="policy 'sums' has --n-samples-per-prompt 3 and this "
                                                             "episode's policy 'add' 2"):
                await client.chat.completions.create(model="sums", messages=ask)
        alone = _context(engine, tokenizer, policy=None)
        url = served.open(ChatSession(alone, GROUP, 0), AgentCalls(alone, GROUP))
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError, match="model 'sums' is not served here: this run has one "
                                                           "policy, served as 'tiny'"):
                await client.chat.completions.create(model="sums", messages=ask)
    finally:
        await served.stop()
    first, second = calls.samples({0: {"asked": "x", "tool_calls": 9}})
    assert first.metadata["asked"] == "x" and first.metadata["tool_calls"] == 0  # the counts are sums' own
    assert first.metadata["turns"] == 1 and first.status != "failed"
    assert second.status == "failed" and second.error == (
        "episode 1 of group 0:3 (add) made no call to policy sums: its group 0:3@sums.agent holds each episode's "
        "calls to sums")
    own = served.sessions  # every session above was left open: the episode's own conversation got add's calls only
    assert sorted(session.model_turns for session in own.values()) == [0, 0, 0, 2]
@pytest.mark.timeout(120)
async def test_episodes_feeding_a_policy_whose_adopted_backlog_is_full_wait_until_its_learner_takes_some(
        tmp_path: Path, tiny_model_path: Path) -> None:
    """Every episode of "add" makes a group of sums' turns; sums trains only those (its own prompts are filtered
    out) and may keep 2 waiting. With no learner draining sums' pool, add's lane stops leasing once sums' room is
    spent, although add's admission allows 42 groups; a batch taken from sums' pool lets it go on."""
    settings = {"hf_checkpoint": str(tiny_model_path), "rollout_engine": "torch", "lora_rank": 4,
                "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "n_samples_per_prompt": 2,
                "rollout_batch_size": 2, "rollout_max_batch_size": 2, "rollout_max_response_len": 4,
                "custom_generate_function_path": "tests.support.cross_policy:add_then_sums",
                "use_tensorboard": False, "plots": False,
                "policies": {"add": {"max_staleness": 20},
                             "sums": {"max_adopted_waiting": 2, "dynamic_sampling_filter_path": ADD_TURNS_ONLY}}}
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        add = await start_actor(system, "buffer", "buffer", policy="add")
        sums = await start_actor(system, "buffer", "buffer", policy="sums")
        await start_actor(system, "reward", "reward", policy=None)
        worker = await start_actor(system, "rollout", "rollout", policy=None)
        lane = worker.lane_of("add")
        await system.wait_for(lambda: lane.crossing.holds == 1, HANG_S, "add's lane to hold its episodes back")

        def settled() -> bool:  # add's episodes in flight at the hold have reached sums' buffer
            return not lane.held_leases and len(sums.core.adopted) == add.counters["groups.leased"]
        await system.wait_for(settled, HANG_S, "add's last episodes to reach sums' buffer")
        leased, own = add.counters["groups.leased"], sums.counters[f"groups.dropped.{ADD_TURNS_ONLY}"]
        await system.wait_for(lambda: sums.counters[f"groups.dropped.{ADD_TURNS_ONLY}"] >= own + 4, HANG_S,
                              "4 more groups of sums' own prompts generated (and filtered out)")
        assert add.counters["groups.leased"] == leased <= 4 < (20 + 1) * 2  # the engine was free: the hold stopped add
        assert lane.crossing.since is not None and lane.crossing.holds == 1
        assert any(wait.on == "buffer@sums" for wait in worker.waits.snapshot())  # whom the hang report names
        assert 2 <= adopted_waiting(sums.core) <= 2 + 2  # over only by episodes running before the room was heard
        assert sums.counters["groups.adopted_over_bound"] == adopted_waiting(sums.core) - 2

        learner = RpcClient(sums.zmq, sums.endpoints()["rpc"], client_id="learner@sums")
        try:
            batch = await learner.call(BatchRequest(learner_version=0, trained_batch=0, checkpointed_batch=0),
                                       timeout=10.0, retries=0)
        finally:
            learner.close()
        assert isinstance(batch, Batch) and all(s.metadata["host_policy"] == "add" for s in batch.samples)
        await system.wait_for(lambda: add.counters["groups.leased"] > leased, HANG_S, "add's lane to lease again")
        metrics = worker.metrics()
        assert lane.crossing.since is None or lane.crossing.holds > 1
        assert metrics["rollout.held_back.add"] >= 1 and metrics["rollout.held_back_s.add"] > 0
        assert metrics["rollout.held_back.sums"] == 0  # sums' episodes feed nobody
        assert sums.metrics()["buffer.adopted_waiting"] == adopted_waiting(sums.core)
