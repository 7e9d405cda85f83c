"""A rollout worker in a run of two policies: one lane per policy, each leasing from its own buffer, generating with
its own adapter at its own version, and sending its groups on under its policy's name.

Real actors on real sockets in one process (tests/support/inprocess.py): the controller, each policy's buffer with
the context the launcher gives a policy's actor, a recording reward worker, and the worker on a torch engine. The
learners are the test: one pushes its adapter over a real gloo group, as learner@a does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from actors.config.policies import scoped_actor_id
from actors.rollout.lanes import AdapterEngine
from bus import RpcClient
from bus.schema import Ack, Roster, RosterEvent, VersionAnnouncement, WeightUpdateOrder
from engines.inference import GenerateRequest, SamplingParams
from engines.weights.transport import SenderOptions, resolve_transport
from tests.support.adapters import random_adapter
from tests.support.inprocess import ActorSystem, GroupRecorder, actor_system, write_prompts
from tests.support.policies import start_actor

pytestmark = pytest.mark.integration
POLICIES = ("a", "b")


def _settings(tmp_path: Path, tiny_model_path: Path, **overrides: object) -> dict[str, object]:
    return {"hf_checkpoint": str(tiny_model_path), "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")),
            "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_batch_size": 2,
            "rollout_max_response_len": 8, "lora_rank": 4, "lora_alpha": 8,
            "policies": {"a": {}, "b": {"rollout_temperature": 0.5}},
            "use_tensorboard": False, "plots": False, **overrides}


async def _two_policy_worker(system: ActorSystem) -> Any:
    """Each policy's buffer, as the launcher starts a policy's actor, then the shared reward and rollout workers."""
    for policy in POLICIES:
        await start_actor(system, "buffer", "buffer", policy=policy)
    await start_actor(system, "reward", GroupRecorder, policy=None)
    return await start_actor(system, "rollout", "rollout", policy=None)


async def _push_adapter(worker: Any, policy: str, version: int) -> Ack | Any:
    """What learner@<policy> does for a push: its own group, an order naming its adapter, the broadcast."""
    transport = resolve_transport("torch_distributed")
    sender = transport.make_sender(SenderOptions(host="127.0.0.1", backend="gloo", timeout_s=30.0))
    client = RpcClient(worker.zmq, worker.endpoints()["rpc"], client_id=scoped_actor_id("learner", policy))
    try:
        group = sender.open_group([scoped_actor_id("learner", policy), worker.actor_id]).to_dict()
        order = WeightUpdateOrder(version=version, group=group, timeout_s=30.0, adapter=policy)
        reply = asyncio.ensure_future(client.call(order, timeout=60.0, retries=0))
        await asyncio.to_thread(sender.wait_for_receivers)
        model = AutoModelForCausalLM.from_pretrained(worker.config.model.hf_checkpoint)
        await asyncio.to_thread(sender.send, iter(random_adapter(model, 4, version, scale=0.5)), version)
        return await reply
    finally:
        client.close()
        sender.close()


@pytest.mark.timeout(120)
async def test_each_policys_lane_leases_from_its_own_buffer_and_sends_its_groups_under_its_name(
        tmp_path: Path, tiny_model_path: Path) -> None:
    # No learner announces a version, so each buffer starts (max_staleness + 1) * rollout_batch_size groups at most:
    # a's bound leaves room for its groups after the push however many it started before the push was done.
    policies = {"a": {"max_staleness": 50}, "b": {"rollout_temperature": 0.5}}
    settings = _settings(tmp_path, tiny_model_path, policies=policies)
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        worker = await _two_policy_worker(system)
        recorder = system["reward-0-0"]
        sent = lambda policy: [group for group in recorder.groups if group.policy == policy]  # noqa: E731
        await system.wait_for(lambda: all(len(sent(policy)) >= 2 for policy in POLICIES), 60,
                              "two groups of each policy")
        # the engine's rows hold one group: the lanes take them in turn, neither starving the other
        assert [group.policy for group in recorder.groups[:4]] == ["a", "b", "a", "b"]
        assert [lane.policy for lane in worker.lanes] == list(POLICIES)
        assert all(isinstance(lane.engine, AdapterEngine) for lane in worker.lanes)
        for policy in POLICIES:
            assert system[scoped_actor_id("buffer", policy)].counters["groups.leased"] >= 2
            assert {int(v) for group in sent(policy) for s in group.samples for v in s.token_versions} == {0}

        # learner@a pushes its adapter: a's lane moves to version 1, b's stays on its fresh adapter
        assert isinstance(await _push_adapter(worker, "a", 1), Ack)
        assert (worker.lane_of("a").engine.version, worker.lane_of("b").engine.version, worker.engine.version) == (
            1, 0, 0)
        assert worker.metrics()["engine.version.a"] == 1.0
        before = len(recorder.groups)
        versions = lambda group: {int(v) for s in group.samples for v in s.token_versions}  # noqa: E731
        # a group leased before the push may mix 0 and 1; a's next ones are all version 1, b's never move
        await system.wait_for(lambda: any(versions(g) == {1} for g in recorder.groups[before:] if g.policy == "a"),
                              60, "a group of a's generated wholly at version 1 after its push")
        assert all(versions(g) <= {0} for g in recorder.groups[before:] if g.policy == "b")


@pytest.mark.timeout(120)
async def test_an_announcement_of_one_policy_moves_only_its_lane(tmp_path: Path, tiny_model_path: Path) -> None:
    """b's learner announcing version 5 makes b's weights too old for its buffer (staleness 0 for b); a's lane, and
    its groups, go on."""
    settings = _settings(tmp_path, tiny_model_path, policies={"a": {}, "b": {"max_staleness": 0}})
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        worker = await _two_policy_worker(system)
        await worker.on_version("version", VersionAnnouncement(version=5, weights_version=5, step=5, policy="b"))
        assert worker.weights_too_old(worker.lane_of("b")) and not worker.weights_too_old(worker.lane_of("a"))
        assert worker.lane_of("a").versions.announced == 0
        assert worker._oldest_accepted("b") == 5 and worker._oldest_accepted("a") == 0
        recorder = system["reward-0-0"]
        before = len(recorder.groups)
        await system.wait_for(lambda: sum(g.policy == "a" for g in recorder.groups[before:]) >= 2, 60,
                              "a's groups while b waits for its weights")


@pytest.mark.timeout(120)
async def test_a_joined_policy_gets_a_lane_on_the_shared_engine_unless_it_has_engines_of_its_own(
        tmp_path: Path, tiny_model_path: Path) -> None:
    """The roster names two policies that joined the running job: c, on the run's engines, gets a lane and its
    adapter served; solo, with engines of its own (own_engines), neither: its own workers generate for it."""
    async with actor_system(tmp_path, _settings(tmp_path, tiny_model_path), {"controller": "controller"}) as system:
        worker = await _two_policy_worker(system)
        joined = {**worker.config.policies, "c": {}, "solo": {"own_engines": 1, "lora_rank": 0}}
        await worker.on_roster(Roster(generation=99, members=list(worker.roster.values()), policies=joined))
        assert [lane.policy for lane in worker.lanes] == [*POLICIES, "c"]
        greedy = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
        assert await worker.engine.generate(GenerateRequest("c", [3, 14, 15], greedy, adapter="c"))
        with pytest.raises(ValueError, match="adapter 'solo' is not loaded on this engine"):
            await worker.engine.generate(GenerateRequest("solo", [3, 14, 15], greedy, adapter="solo"))


async def test_an_adapter_view_names_its_adapter_unless_a_request_names_one(tiny_model_path: Path) -> None:
    from engines.inference import TorchEngine

    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path), None, lora_scaling=2.0,
                         adapters=("a", "b"))
    view = AdapterEngine(engine, "a")
    greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    try:
        await view.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 3)
        assert (view.version, engine.adapter_version("a"), engine.version) == (3, 3, 0)
        (mine,) = await view.generate(GenerateRequest("mine", [3, 14, 15], greedy))
        (other,) = await view.generate(GenerateRequest("other", [3, 14, 15], greedy, adapter="b"))
        assert (set(mine.versions), set(other.versions)) == ({3}, {0})
        (direct,) = await engine.generate(GenerateRequest("direct", [3, 14, 15], greedy, adapter="a"))
        assert mine.output_ids == direct.output_ids
        await view.close()
        assert (await engine.health())["healthy"]  # closing a view closes nothing
    finally:
        await engine.close()


@pytest.mark.timeout(120)
async def test_groups_lost_with_a_reward_worker_go_back_to_each_policys_own_buffer(
        tmp_path: Path, tiny_model_path: Path) -> None:
    """The recording reward worker never scores: every group it was handed is in flight at its policy's buffer, and
    its death sends each buffer the groups of its own policy, none of the other's."""
    async with actor_system(tmp_path, _settings(tmp_path, tiny_model_path), {"controller": "controller"}) as system:
        worker = await _two_policy_worker(system)
        recorder = system["reward-0-0"]
        await system.wait_for(lambda: all(sum(g.policy == p for g in recorder.groups) >= 2 for p in POLICIES), 60,
                              "two groups of each policy handed to the reward worker")
        handed = {policy: sum(group.policy == policy for group in recorder.groups) for policy in POLICIES}
        worker.request_stop("test: no more groups")  # what it hands on from now is not counted below
        await worker.on_roster(Roster(generation=99, members=list(worker.roster.values()),
                                      events=[RosterEvent(kind="died", actor_id="reward-0-0", reason="test")]))
        for policy in POLICIES:
            assert system[scoped_actor_id("buffer", policy)].counters["groups.lost_reissued"] >= handed[policy]
