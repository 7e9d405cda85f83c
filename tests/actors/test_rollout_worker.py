"""The real RolloutWorker, in process, with the sleeping engine: leases, generation, renewal, weight orders.

The controller and the buffer are the real actors on real sockets in the same process; the reward side is a
small recording actor (tests/support/inprocess.py), so a test sees exactly what the worker sent on.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from actors.buffer.actor import Buffer
from actors.config import build_config
from actors.rollout import actor as rollout_actor
from actors.rollout.engine_factory import load_engine
from actors.rollout.failures import unless_aborted
from bus import RpcClient
from bus.schema import Ack, Lease, LeaseRequest, PromptGroup, Sample, VersionAnnouncement, WeightUpdateOrder
from engines.inference.base import InferenceEngine
from policies.plugins import PluginError
from policies.registry import ADVANTAGE_ESTIMATORS, CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES, Registry
from tests.support.inprocess import SLEEPING, GroupRecorder, actor_system, use_spec, write_prompts
from tools.sim.pipeline import VERSION_ONLY, SimSpec, SleepingEngine, SleepingTokenizer

REPO = Path(__file__).resolve().parents[2]
ROLES = {"controller": "controller", "buffer": "buffer", "reward": GroupRecorder, "rollout": "rollout"}


def _settings(tmp_path: Path, **overrides: object) -> dict[str, object]:
    return {**SLEEPING, "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "rollout_batch_size": 2,
            "n_samples_per_prompt": 2, "rollout_max_batch_size": 2, "rollout_max_response_len": 64,
            "use_tensorboard": False, "plots": False, **overrides}


async def order_weights(worker: Any, version: int = 1) -> Ack | Any:
    """What the learner sends a worker for a push (weights as version numbers only); returns the worker's answer."""
    client = RpcClient(worker.zmq, worker.endpoints()["rpc"], client_id="test-learner")
    try:
        order = WeightUpdateOrder(version=version, group={"transport": VERSION_ONLY.name,
                                                          "receivers": [worker.actor_id]}, timeout_s=5.0)
        return await client.call(order, timeout=5.0, retries=0)
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_leased_group_is_generated_and_sent_on_with_versions_and_log_probs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec(SimSpec(token_seconds=1e-3, length_min=16, length_max=64, correct_fraction=1.0), tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path), ROLES) as system:
        recorder = system["reward-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 2, 10, "two generated groups")
        buffer, worker = system["buffer"], system["rollout-0-0"]
        assert isinstance(worker.engine, SleepingEngine)
        assert buffer.counters["groups.leased"] >= 2
    group = recorder.groups[0]
    assert group.worker_id == "rollout-0-0" and len(group.samples) == 2
    for sample in group.samples:
        length = sample.response_length
        assert 16 <= length <= 64 and len(sample.tokens) == sample.prompt_tokens + length
        assert sample.token_versions.tolist() == [0] * length
        assert len(sample.rollout_log_probs) == length and np.all(sample.rollout_log_probs <= 0)
        assert sample.response.endswith(f"\\boxed{{{sample.label}}}")  # the tokenizer decoded the engine's ids


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_weight_order_mid_generation_tags_later_tokens_with_the_new_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every response is 40 tokens of 50 ms: the order lands about a quarter of the way in.
    use_spec(SimSpec(token_seconds=0.05, length_min=40, length_max=40), tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path, rollout_max_batch_size=2), ROLES) as system:
        worker, recorder = system["rollout-0-0"], system["reward-0-0"]
        await system.wait_for(lambda: worker.groups_in_flight > 0, 10, "a group in generation")
        await asyncio.sleep(0.5)
        reply = await order_weights(worker)
        assert isinstance(reply, Ack) and reply.ok
        assert worker.engine.version == 1 and worker.counters["weights.updates"] == 1
        await system.wait_for(lambda: len(recorder.groups) >= 1, 10, "the group in generation")
    versions = recorder.groups[0].samples[0].token_versions.tolist()
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_a_lease_held_longer_than_its_timeout_is_renewed_not_reissued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A group takes 2.4 s; a lease lasts 1.2 s unless renewed (every 0.5 s by the worker).
    use_spec(SimSpec(token_seconds=0.08, length_min=30, length_max=30), tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path, lease_timeout=1.2, rollout_max_batch_size=2),
                            ROLES) as system:
        worker, buffer, recorder = system["rollout-0-0"], system["buffer"], system["reward-0-0"]
        await system.wait_for(lambda: bool(worker.held_leases), 10, "a held lease")
        lease_id = next(iter(worker.held_leases))
        first_expiry = buffer.core.leases[lease_id].expires_at
        await asyncio.sleep(1.6)  # past the unrenewed expiry, while the group is still generating
        assert lease_id in buffer.core.leases, "the buffer let the lease expire: it was not renewed"
        assert buffer.core.leases[lease_id].expires_at > first_expiry
        await system.wait_for(lambda: len(recorder.groups) >= 1, 10, "the long group")
        gauges = worker.metrics()  # what the pipeline benchmark reads: slot-seconds in flight, groups handed on
        assert 2.4 <= gauges["rollout.busy_slot_seconds"] <= gauges["uptime_s"]
        assert gauges["groups.sent"] == 1 and gauges["rollout.capacity_groups"] == 1
    assert recorder.groups[0].lease_id == lease_id


@pytest.mark.unit
def test_plugin_engine_factory_builds_the_engine_and_its_tokenizer(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec(SimSpec(), tmp_path, monkeypatch)
    engine, tokenizer = load_engine(build_config(SLEEPING), "rollout-0-3")
    assert isinstance(engine, InferenceEngine) and isinstance(tokenizer, SleepingTokenizer)
    assert tokenizer.decode(tokenizer("What is 1 + 2?")["input_ids"]) == "What is 1 + 2?"


@pytest.mark.unit
@pytest.mark.parametrize(("path", "message"), [
    ("builtins:slice", r"--rollout-engine 'builtins:slice': the factory returned slice, expected a pair"),
    ("tools.sim.pipeline:SPEC_FILE", r"--rollout-engine 'tools.sim.pipeline:SPEC_FILE': str is not callable"),
    ("tools.sim.pipeline:VERSION_ONLY", r"--rollout-engine 'tools.sim.pipeline:VERSION_ONLY': WeightTransport is "
                                        r"not callable"),
])
def test_a_wrong_engine_plugin_is_named_by_flag_and_path(path: str, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        load_engine(build_config({"rollout_engine": path}), "rollout-0-0")


@pytest.mark.unit
def test_a_missing_engine_plugin_is_named_by_flag_and_path() -> None:
    with pytest.raises(PluginError, match=r"--rollout-engine 'tools.sim.pipeline:nowhere'.*no attribute 'nowhere'"):
        load_engine(build_config({"rollout_engine": "tools.sim.pipeline:nowhere"}), "rollout-0-0")


@pytest.mark.unit
@pytest.mark.parametrize("registry", [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, CORRECTIONS])
def test_policy_names_checked_without_importing_are_exactly_the_registered_built_ins(registry: Registry) -> None:
    assert registry.builtin_names == set(registry.names())
    with pytest.raises(ValueError, match=f"unknown {registry.kind} 'nonesuch'"):
        registry.check("nonesuch")


@pytest.mark.unit
def test_an_engine_that_is_neither_built_in_nor_a_path_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match=r"^rollout_engine vllm: expected one of torch, sglang, or a plugin"):
        build_config({"rollout_engine": "vllm"})


@pytest.mark.integration
def test_a_worker_waits_for_its_engine_to_load_torch_and_no_actor_module_imports_aiohttp() -> None:
    """Two import budgets, measured in one fresh interpreter (each check is on what was imported up to it).

    What a worker process does before its engine factory runs (import its class, validate the run's config, which
    checks every policy name, build the sleeping engine and resolve the weight transport's loader) imports neither
    torch nor transformers. And no actor module imports aiohttp unless an HTTP feature is used: it costs 0.11 s to
    import; the rollout worker's modules sit in the actor template's heavy preload, which the learner and every
    rollout worker wait for, and only agents, slime's HTTP helpers, remote reward models and SGLang need it."""
    code = ("import sys; from actors.runtime.roles import BUILTIN_ROLES, resolve_actor_class; "
            "resolve_actor_class('actors.rollout.actor:RolloutWorker'); "
            "from actors.config import build_config; "
            "build_config({'advantage_estimator': 'grpo', 'loss_type': 'ppo', 'kl_loss_type': 'k3', "
            "'off_policy_correction': 'icepop'}); "
            "from engines.weights.transport import resolve_transport; "
            "resolve_transport('tools.sim.pipeline:VERSION_ONLY').make_loader(None, 'rollout-0-0', None); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
            "[resolve_actor_class(path) for path in BUILTIN_ROLES.values()]; "
            "import actors.rollout.engine_factory, actors.learner.trainer_factory; "
            "from policies.rewards.selection import build_reward; "
            "print('aiohttp' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # torch and transformers before the engine factory; aiohttp once every actor module is imported
    assert result.stdout.splitlines() == ["[]", "False"]


@pytest.mark.integration
@pytest.mark.timeout(40)
async def test_a_synchronous_worker_starts_the_next_batch_when_the_weights_land_not_when_the_version_is_announced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leasing on the announcement generated whole groups with the previous weights, which the buffer then evicted
    as one version stale (half a group per step in a 300-step run); the worker must wait for the weights."""
    use_spec(SimSpec(token_seconds=0.001, length_min=2, length_max=2), tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path, max_staleness=0), ROLES) as system:
        worker, buffer, recorder = system["rollout-0-0"], system["buffer"], system["reward-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 2, 10, "batch 1's groups")
        assert buffer.core.lease("probe", 1) is None  # synchronous: nothing more until the learner steps
        await worker.on_version("version", VersionAnnouncement(version=1, weights_version=0, step=1))
        buffer.core.note_version(step=1, version=1)  # the buffer heard it too: batch 2 may start
        await asyncio.sleep(0.6)
        assert len(recorder.groups) == 2, "generated batch 2 with version 0's weights"
        assert isinstance(await order_weights(worker), Ack)
        await system.wait_for(lambda: len(recorder.groups) >= 4, 10, "batch 2's groups")
    assert {int(v) for group in recorder.groups[2:] for s in group.samples for v in s.token_versions} == {1}


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_worker_told_nothing_now_asks_again_as_soon_as_the_next_version_is_announced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synchronous worker polled the buffer every 50 ms between batches, so each step lost up to a poll (~6% of
    the CPU demo's sync steps/s); the announcement that opens admission must wake it. Here the poll is 30 s."""
    use_spec(SimSpec(token_seconds=0.001, length_min=2, length_max=2), tmp_path, monkeypatch)
    monkeypatch.setattr(rollout_actor, "IDLE_POLL_S", 30.0)
    async with actor_system(tmp_path, _settings(tmp_path, max_staleness=0), ROLES) as system:
        worker, buffer, recorder = system["rollout-0-0"], system["buffer"], system["reward-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 2, 10, "batch 1's groups")
        # Version 1's weights land first: the worker asks, hears "nothing now", and waits.
        assert isinstance(await order_weights(worker), Ack)
        await asyncio.sleep(0.3)
        assert len(recorder.groups) == 2 and buffer.core.lease("probe", 1) is None
        buffer.core.note_version(step=1, version=1)  # the learner's announcement reaches the buffer, then the worker
        await worker.on_version("version", VersionAnnouncement(version=1, weights_version=1, step=1))
        await system.wait_for(lambda: len(recorder.groups) >= 4, 10, "batch 2's groups, well before the next poll")


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_stop_ends_a_workers_wait_for_work_or_weights_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between leases a worker waits for an announcement, landed weights, or its poll (up to 0.5 s); a stop
    meanwhile waited out the poll, and a run's end waits for every worker's. The wait here would be 30 s."""
    use_spec(SimSpec(token_seconds=0.001, length_min=2, length_max=2), tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path), ROLES) as system:
        worker = system["rollout-0-0"]
        waiting = asyncio.create_task(worker._until_set([asyncio.Event()], 30.0))
        await asyncio.sleep(0)  # the wait has begun
        worker.request_stop("test: the run stops")
        await asyncio.wait_for(waiting, 5)


class HoldsALeaseRequest(Buffer):
    """The real buffer, except that it answers the first lease request after `release` is set up only once
    `release` is set."""

    release: asyncio.Event | None = None
    asked: asyncio.Event | None = None

    async def on_lease_request(self, sender: str, request: LeaseRequest) -> Lease:
        if self.release is not None and self.asked is not None:
            self.asked.set()
            await self.release.wait()
            self.release = None
        return await super().on_lease_request(sender, request)


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_weights_that_land_while_a_too_old_worker_asks_for_work_are_not_waited_for_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's weights become too old to train on while its lease request is out, and the new weights land
    before the answer: it must decide on the weights it has when the answer comes and go on with them, not wait
    out its weights timeout (a sync step lost 0.2 s, seen in bench_pipeline once workers woke on the
    announcement). Here the timeout is 30 s. The request is held from before the announcement: a request answered
    after it but sent before is the race this order pins down."""
    use_spec(SimSpec(token_seconds=0.001, length_min=2, length_max=2), tmp_path, monkeypatch)
    monkeypatch.setattr(rollout_actor, "WEIGHTS_POLL_S", 30.0)
    roles = {**ROLES, "buffer": HoldsALeaseRequest}
    async with actor_system(tmp_path, _settings(tmp_path, max_staleness=0), roles) as system:
        worker, buffer, recorder = system["rollout-0-0"], system["buffer"], system["reward-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 2, 10, "batch 1's groups")
        buffer.release, buffer.asked = asyncio.Event(), asyncio.Event()
        await asyncio.wait_for(buffer.asked.wait(), 10)  # the idle worker's next poll, now held
        buffer.core.note_version(step=1, version=1)
        await worker.on_version("version", VersionAnnouncement(version=1, weights_version=0, step=1))
        assert worker.weights_too_old()  # our weights (0) are too old for version 1's batch
        assert isinstance(await order_weights(worker), Ack)
        buffer.release.set()  # answered after version 1's weights landed
        await system.wait_for(lambda: len(recorder.groups) >= 4, 10, "batch 2's groups with version 1's weights")


class LosesALeaseRequest(Buffer):
    """The real buffer, except that the first lease request after `lose` is set is lost: no answer, nothing
    cached, so the worker's retry of it is served as if it were the first to arrive."""

    lose: asyncio.Event | None = None
    lost_at: float | None = None
    served_after: float | None = None

    async def on_lease_request(self, sender: str, request: LeaseRequest) -> Lease:
        loop = asyncio.get_running_loop()
        if self.lose is not None and self.lost_at is None:
            self.lost_at = loop.time()
            raise asyncio.CancelledError  # as if the frame never came: the RPC server neither answers nor caches
        if self.lost_at is not None and self.served_after is None:
            self.served_after = loop.time() - self.lost_at
        return await super().on_lease_request(sender, request)


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_lost_lease_request_is_asked_again_within_a_second_not_after_five(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease request or its answer lost on the way (a restarting buffer; the chaos matrix's faulty bus) left the
    worker idle for its 5 s attempt timeout, twice in one chaos run; the buffer answers at once, so a second with
    no answer is enough to ask again."""
    use_spec(SimSpec(token_seconds=0.001, length_min=2, length_max=2), tmp_path, monkeypatch)
    roles = {**ROLES, "buffer": LosesALeaseRequest}
    async with actor_system(tmp_path, _settings(tmp_path), roles) as system:
        buffer, recorder = system["buffer"], system["reward-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 2, 10, "batch 1's groups")
        buffer.lose = asyncio.Event()
        await system.wait_for(lambda: buffer.served_after is not None, 10, "the lost request asked again")
        assert buffer.served_after < rollout_actor.LEASE_ATTEMPT_S + 1.5, buffer.served_after


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_stop_does_not_wait_for_the_answer_to_a_lease_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose buffer is gone (its node lost the head) asks for work that never comes: stopped meanwhile, it
    waited out the request's timeouts (5 s, three times) before it noticed the stop, on the path of every launcher
    that stops its node. The drain window here is longer than those, so only the stop itself can end the wait."""
    use_spec(SimSpec(token_seconds=0.001, length_min=2, length_max=2), tmp_path, monkeypatch)
    roles = {**ROLES, "buffer": HoldsALeaseRequest}
    async with actor_system(tmp_path, _settings(tmp_path), roles) as system:
        worker, buffer, recorder = system["rollout-0-0"], system["buffer"], system["reward-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 2, 10, "batch 1's groups")
        buffer.release, buffer.asked = asyncio.Event(), asyncio.Event()
        await asyncio.wait_for(buffer.asked.wait(), 10)  # the worker's next request, never answered
        worker.drain_timeout = 60.0
        worker.request_stop("node stopping: head node lost")
        assert await asyncio.wait_for(system.tasks["rollout-0-0"], 45) == 0
        assert worker.counters["lease.unanswered"] == 0, "the worker waited for the request to time out"
        assert not buffer.release.is_set()
        buffer.release.set()


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_one_sample_eval_groups_fill_every_row_of_the_engine(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Four engine rows, training groups of two samples: an eval round's one-sample groups run four at a time."""
    use_spec(SimSpec(token_seconds=0.05, length_min=20, length_max=20), tmp_path, monkeypatch)
    settings = _settings(tmp_path, rollout_max_batch_size=4, rollout_batch_size=1, max_staleness=0)
    async with actor_system(tmp_path, settings, ROLES) as system:
        worker, buffer = system["rollout-0-0"], system["buffer"]
        buffer.core.add_guests([PromptGroup(group_id=f"eval:held:0:{index}", prompt="1+1=", is_eval=True,
                                            owner="evaluator", weights_version=0) for index in range(8)])
        await system.wait_for(lambda: worker.groups_in_flight == 4, 10, "four eval groups in flight at once")
        assert worker.rows_in_flight == 4 and worker.capacity == 2  # two training groups' worth of rows


ABORTED_ONCE: set[str] = set()


async def aborted_the_first_time(context: Any, group: Any) -> list[Any]:
    """A generate plugin that calls the server itself and does not resume what a weight update's pause aborted:
    its first answer for each group comes back aborted and empty, as SGLang returns such a request."""
    from actors.plugins import default_generate

    samples = await default_generate(context, group)
    if group.group_id in ABORTED_ONCE:
        return samples
    ABORTED_ONCE.add(group.group_id)
    return [msgspec.structs.replace(sample, status="aborted", response="", response_length=0,
                                    tokens=sample.tokens[:sample.prompt_tokens], loss_mask=sample.loss_mask[:0],
                                    rollout_log_probs=sample.rollout_log_probs[:0],
                                    token_versions=sample.token_versions[:0])
            for sample in samples]


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_a_group_whose_generation_was_aborted_is_generated_again_never_sent_half_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in a slime-style run: a custom generate function's requests aborted by a weight update's pause came
    back empty, were scored, batched and trained (a step with no trained token)."""
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    ABORTED_ONCE.clear()
    settings = _settings(tmp_path, custom_generate_function_path=f"{__name__}:aborted_the_first_time")
    async with actor_system(tmp_path, settings, ROLES) as system:
        recorder, worker = system["reward-0-0"], system["rollout-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 2, 10, "two generated groups")
        regenerated = worker.counters["groups.regenerated_after_abort"]
    assert all(sample.status != "aborted" and sample.response_length >= 4
               for group in recorder.groups for sample in group.samples)
    assert regenerated >= 2


class _Log:
    """The worker's structured logger, keeping what was warned."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, event: str, **_: Any) -> None:
        self.warnings.append(event)


@pytest.mark.unit
async def test_a_group_aborted_by_the_runs_own_stop_is_dropped_without_a_warning() -> None:
    """Every run used to end with one 'kept being aborted' warning per group in flight, for the stop it asked for."""
    from collections import Counter

    aborted = [Sample(sample_id="g/0", group_id="g", index=0, prompt="1+1=", status="aborted")]
    group = PromptGroup(group_id="g", prompt="1+1=")
    worker = types.SimpleNamespace(stopping=True, counters=Counter(), log=_Log())
    generate = lambda context, group: asyncio.sleep(0, result=aborted)  # noqa: E731
    assert await unless_aborted(generate, None, group, aborted, worker=worker) is None
    assert worker.log.warnings == [] and worker.counters["groups.aborted_at_stop"] == 1
    worker.stopping = False
    assert await unless_aborted(generate, None, group, aborted, worker=worker) is None
    assert worker.log.warnings == ["generation of a group kept being aborted; not sent, its lease will bring it back"]


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_worker_stopping_with_agent_episodes_in_flight_aborts_them_and_closes_its_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `--agent-function-path` run ended with 'on_stop failed ... TimeoutError': the endpoint was stopped first
    and waited for its calls, which waited for an engine nobody had aborted; the engine was never closed. The group
    in flight is not sent (its lease brings it back), and says so as a group aborted at the stop."""
    from structlog.testing import capture_logs

    # Four tokens of ten minutes each: only an abort ends a call.
    use_spec(SimSpec(token_seconds=600.0, length_min=4, length_max=4), tmp_path, monkeypatch)
    settings = _settings(tmp_path, agent_function_path="tests.support.agents:one_call")
    with capture_logs() as logs:
        async with actor_system(tmp_path, settings, ROLES) as system:
            worker = system["rollout-0-0"]
            await system.wait_for(lambda: len(worker.generate_fn.endpoint.busy) == 2, 10, "two calls in the engine")
            worker.request_stop("test over")
            assert await system.tasks["rollout-0-0"] == 0
    assert worker.engine._closed and worker.generate_fn.endpoint.runner is None
    assert [entry for entry in logs if entry["event"] == "on_stop failed"] == []
    assert worker.counters["groups.aborted_at_stop"] == 1 and system["reward-0-0"].groups == []
