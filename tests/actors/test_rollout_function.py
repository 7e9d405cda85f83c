"""slime's --rollout-function-path, its pieces without sockets: the data source a rollout function gets (leasing
from a real BufferCore on a real event loop in another thread, as the worker's loop is), the grouping and checks of
what the function returns, and the daemon thread that calls it."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from actors.buffer.core import BufferCore
from actors.config import build_config
from actors.data.prompts import PromptRecord, PromptSource
from actors.rollout.failures import GenerateFailures
from actors.slime_compat import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample
from actors.slime_compat.data_source import GROUP_KEY, Held, LeasedDataSource, WorkerStopping
from actors.slime_compat.rollout_function import (
    FunctionThread,
    RolloutFunctionRunner,
    check_rollout_function,
    flatten_output,
    sort_output,
    wire_group,
)
from bus.schema import Lease, PromptGroup

N = 2  # samples per group
B = 3  # groups per batch
PATH = "tests.fake:generate_rollout"


class CoreGroups:
    """A rollout worker's side of the data source over a real BufferCore: its leases, holds and releases."""

    def __init__(self, core: BufferCore) -> None:
        self.core = core
        self.stopping = False
        self.requests: list[int] = []
        self.held: Counter[str] = Counter()
        self.generated_eval: list[str] = []

    async def request_lease(self, max_groups: int) -> Lease | None:
        self.requests.append(max_groups)
        leased = self.core.lease("rollout-0-0", max_groups)
        if leased is None:
            return None
        lease_id, groups = leased
        return Lease(lease_id=lease_id, worker_id="rollout-0-0", groups=groups, expires_at=0.0, version=0)

    def hold(self, lease: Lease) -> None:
        self.held[lease.lease_id] += len(lease.groups)

    def generate_group(self, lease: Lease, group: PromptGroup) -> None:
        self.generated_eval.append(group.group_id)

    async def release(self, lease_id: str, group: PromptGroup) -> None:
        self.held[lease_id] -= 1


def make_source(loop: asyncio.AbstractEventLoop, *, max_staleness: int = 1,
                lease_timeout: float = 5.0) -> tuple[LeasedDataSource, CoreGroups]:
    records = [PromptRecord(i, f"{i}+1=", str(i + 1), {"topic": "sums"}) for i in range(50)]
    core = BufferCore(source=PromptSource(records, seed=7), n_samples=N, groups_per_batch=B,
                      max_staleness=max_staleness, lease_timeout=60.0)
    groups = CoreGroups(core)
    source = LeasedDataSource(groups, loop, args=None, path=PATH, lease_timeout=lease_timeout)
    return source, groups


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> Any:
    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(5)


def group_id(group: list[Sample]) -> str:
    return group[0].metadata[GROUP_KEY]


@pytest.mark.unit
def test_get_samples_leases_groups_of_n_samples_tagged_with_their_prompt_group(loop) -> None:
    source, groups = make_source(loop)
    taken = source.get_samples(2)
    assert [len(group) for group in taken] == [N, N]
    ids = [group_id(group) for group in taken]
    assert len(set(ids)) == 2 and set(ids) == set(source.held)
    for group in taken:
        leased = source.held[group_id(group)].group
        assert [s.index for s in group] == [0, 1]
        assert all(s.prompt == leased.prompt and s.label == leased.label and s.metadata["topic"] == "sums"
                   for s in group)
        assert all(s.metadata[GROUP_KEY] == leased.group_id and not s.tokens for s in group)
    assert sum(groups.held.values()) == 2


@pytest.mark.unit
def test_put_back_groups_come_first_and_only_the_rest_is_leased(loop) -> None:
    source, groups = make_source(loop)
    first = source.get_samples(3)
    source.add_samples([first[2]])
    assert len(source) == 1 and source.get_buffer_length() == 1
    requests_before = len(groups.requests)
    second = source.get_samples(2)
    assert second[0] is first[2]  # the very samples put back, partial work and all
    assert group_id(second[1]) not in {group_id(g) for g in first}
    assert groups.requests[requests_before:] == [1]
    assert len(source) == 0


@pytest.mark.unit
def test_shortfall_past_the_lease_timeout_names_the_buffer_and_keeps_what_it_got(loop) -> None:
    source, groups = make_source(loop, max_staleness=0, lease_timeout=0.3)  # admits B groups at version 0
    with pytest.raises(TimeoutError, match=rf"{PATH}.*asked the buffer for {B + 1} groups and obtained {B}"):
        source.get_samples(B + 1)
    requests = len(groups.requests)
    again = source.get_samples(B)
    assert len(again) == B and len(groups.requests) == requests  # the kept groups, no new lease


@pytest.mark.unit
def test_evaluation_groups_go_the_workers_own_way_not_to_the_function(loop) -> None:
    source, groups = make_source(loop)
    groups.core.add_guests([PromptGroup(group_id="eval:probe:0", prompt="2+2=", label="4", n_samples=1,
                                        is_eval=True, owner="evaluator")])
    taken = source.get_samples(2)
    assert groups.generated_eval == ["eval:probe:0"]
    assert len(taken) == 2 and "eval:probe:0" not in {group_id(g) for g in taken}
    assert "eval:probe:0" not in source.held


@pytest.mark.unit
def test_add_samples_refuses_groups_it_did_not_hand_out_or_incomplete_ones(loop) -> None:
    source, _ = make_source(loop)
    taken = source.get_samples(1)
    with pytest.raises(ValueError, match=rf"{PATH}.*not one group handed out"):
        source.add_samples([[Sample(), Sample()]])
    with pytest.raises(ValueError, match=rf"{PATH}.*has 1 samples; n_samples_per_prompt is {N}"):
        source.add_samples([taken[0][:1]])
    source.add_samples(taken)
    with pytest.raises(ValueError, match="put back twice"):
        source.add_samples(taken)


@pytest.mark.unit
def test_groups_neither_returned_nor_put_back_are_given_up(loop) -> None:
    source, _ = make_source(loop)
    returned, lost, kept = source.get_samples(3)
    source.add_samples([kept])
    on_loop(loop, lambda: source.settle(group_id(returned)))
    abandoned = on_loop(loop, source.abandoned)
    assert [held.group.group_id for held in abandoned] == [group_id(lost)]
    assert list(source.held) == [group_id(kept)]  # still held, its lease still renewed


@pytest.mark.unit
def test_a_stopping_worker_ends_get_samples(loop) -> None:
    source, groups = make_source(loop)
    groups.stopping = True
    with pytest.raises(WorkerStopping, match=PATH):
        source.get_samples(1)


@pytest.mark.unit
def test_data_source_called_on_the_workers_own_loop_refuses_instead_of_deadlocking(loop) -> None:
    source, _ = make_source(loop)

    async def misuse() -> None:
        source.get_samples(1)

    with pytest.raises(RuntimeError, match="own event loop"):
        asyncio.run_coroutine_threadsafe(misuse(), loop).result(5)


def _held(group_id: str, *, n: int = N, version: int = 0) -> Held:
    group = PromptGroup(group_id=group_id, prompt="1+1=", label="2", n_samples=n, data_index=4)
    return Held(group=group, lease_id="lease-" + group_id, version=version)


def _answered(group_id: str, index: int, *, reward: float | None = 1.0) -> Sample:
    return Sample(index=index, prompt="1+1=", tokens=[5, 6, 7, 8], response="2", response_length=2, reward=reward,
                  rollout_log_probs=[-0.5, -0.25], status=Sample.Status.COMPLETED,
                  metadata={GROUP_KEY: group_id, "data_index": 4})


@pytest.mark.unit
def test_output_is_flattened_and_sorted_into_whole_groups() -> None:
    held = {"a": _held("a"), "b": _held("b")}
    nested = [[[_answered("a", 0)], [_answered("a", 1)]], [_answered("b", 0), _answered("b", 1)]]
    for output in (nested, RolloutFnTrainOutput(samples=nested, metrics={"x": 1})):
        ready, problems = sort_output(flatten_output(output, path=PATH), held, path=PATH)
        assert problems == []
        assert [(entry.group.group_id, [s.index for s in members]) for entry, members in ready] == [
            ("a", [0, 1]), ("b", [0, 1])]


@pytest.mark.unit
def test_incomplete_foreign_and_untagged_groups_are_reported_not_sent() -> None:
    held = {"a": _held("a"), "b": _held("b")}
    stray = _answered("a", 0)
    stray.metadata.pop(GROUP_KEY)
    samples = [_answered("a", 0), _answered("b", 0), _answered("b", 1), _answered("zz", 0), stray]
    ready, problems = sort_output(samples, held, path=PATH)
    assert [entry.group.group_id for entry, _ in ready] == ["b"]
    assert len(problems) == 3 and all(PATH in p for p in problems)
    assert any("group a came back with 1 samples; n_samples_per_prompt is 2" in p for p in problems)
    assert any("group zz" in p and "not held" in p for p in problems)
    assert any("1 returned sample(s) came from no group" in p for p in problems)


@pytest.mark.unit
def test_evaluation_output_or_a_stray_object_is_a_type_error_naming_the_path() -> None:
    with pytest.raises(TypeError, match=rf"{PATH} returned an evaluation output"):
        flatten_output(RolloutFnEvalOutput(data={}), path=PATH)
    with pytest.raises(TypeError, match=rf"{PATH} returned a dict among its samples"):
        flatten_output([[{"tokens": []}]], path=PATH)
    with pytest.raises(TypeError, match=rf"{PATH} returned int"):
        flatten_output(3, path=PATH)


@pytest.mark.unit
def test_wire_group_strips_the_tag_keeps_the_reward_and_dates_tokens_by_the_oldest_version() -> None:
    held = _held("a", version=2)
    wire = wire_group(held, [_answered("a", 0, reward=0.5), _answered("a", 1, reward=None)], start_version=5)
    assert [s.sample_id for s in wire] == ["a/0", "a/1"]
    assert [s.reward for s in wire] == [0.5, None]
    assert all(GROUP_KEY not in s.metadata and s.metadata["data_index"] == 4 for s in wire)
    assert all(s.token_versions.tolist() == [2, 2] for s in wire)  # handed out at 2, returned by a call begun at 5
    assert wire[0].rollout_log_probs.tolist() == [-0.5, -0.25] and wire[0].prompt_tokens == 2


@pytest.mark.unit
def test_function_thread_is_a_daemon_running_sync_and_async_functions_on_one_kept_loop() -> None:
    runner = FunctionThread(name="rollout-function:test")
    assert runner.thread.daemon

    async def which_loop() -> int:
        await asyncio.sleep(0)
        return id(asyncio.get_running_loop())

    def sync_with_its_own_asyncio_run() -> str:
        return asyncio.run(asyncio.sleep(0, result="sync"))

    def raises() -> None:
        raise KeyError("boom")

    assert runner.submit(sync_with_its_own_asyncio_run).result(5) == "sync"
    first, second = runner.submit(which_loop).result(5), runner.submit(which_loop).result(5)
    assert first == second  # aiohttp sessions cached per loop stay usable from one call to the next
    with pytest.raises(KeyError, match="boom"):
        runner.submit(raises).result(5)
    assert runner.submit(lambda: threading.current_thread() is runner.thread).result(5)


@pytest.mark.unit
def test_refused_with_the_torch_engine_or_beside_a_custom_generate_function() -> None:
    path = "examples.slime_style.rollout_function.generate_rollout"
    with pytest.raises(ValueError, match=rf"--rollout-function-path {path}: .*--rollout-engine torch serves none"):
        check_rollout_function(build_config({"rollout_function_path": path, "rollout_engine": "torch"}))
    generate = "examples.slime_style.search_generate:generate"
    with pytest.raises(ValueError, match=rf"{path} replaces generation .*--custom-generate-function-path {generate}"):
        check_rollout_function(build_config({"rollout_function_path": path, "rollout_engine": "sglang",
                                             "custom_generate_function_path": generate}))
    check_rollout_function(build_config({"rollout_function_path": path, "rollout_engine": "sglang"}))


class Worker(CoreGroups):
    """The rest of a rollout worker the runner uses: its config, its engine's address and version, its counters,
    and the hand-off to the reward workers (kept here, to be read)."""

    def __init__(self, core: BufferCore) -> None:
        super().__init__(core)
        self.config = build_config({"rollout_engine": "sglang", "n_samples_per_prompt": N, "rollout_batch_size": B,
                                    "rollout_function_path": PATH})
        self.engine = SimpleNamespace(url="http://127.0.0.1:9", version=3)  # never called: the function makes no HTTP
        self.log = structlog.get_logger()
        self.counters: Counter[str] = Counter()
        self.sent: list[tuple[str, str, list]] = []
        self.failures = GenerateFailures(self.log, self.config)

    def weights_too_old(self) -> bool:
        return False

    async def send_generated(self, lease_id: str, group_id: str, samples: list, *, is_eval: bool = False,
                             eval_set: str | None = None) -> None:
        self.sent.append((lease_id, group_id, samples))
        self.failures.record(samples)

    async def generation_raised(self, item: str, error: Exception, *, samples: int) -> None:
        self.failures.raised(item, error, samples=samples)


def fails_once(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """Takes two groups; the first call raises, later ones answer every sample with one token and reward 1."""
    groups = data_source.get_samples(2)
    if rollout_id == 0:
        raise RuntimeError("the first call fails")
    for group in groups:
        for sample in group:
            sample.tokens, sample.response_length, sample.rollout_log_probs = [1, 2, 3], 1, [-0.1]
            sample.reward = 1.0
    return groups


@pytest.mark.unit
@pytest.mark.timeout(30)
async def test_a_raising_function_is_counted_its_groups_given_up_and_the_next_call_is_sent() -> None:
    records = [PromptRecord(i, f"{i}+1=", str(i + 1), {}) for i in range(50)]
    worker = Worker(BufferCore(source=PromptSource(records, seed=7), n_samples=N, groups_per_batch=B,
                               max_staleness=4, lease_timeout=60.0))
    runner = RolloutFunctionRunner(worker, fails_once, PATH)
    story = asyncio.create_task(runner.run())
    deadline = asyncio.get_running_loop().time() + 20
    while len(worker.sent) < 2 and not story.done() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    worker.stopping = True
    await asyncio.wait_for(story, 10)
    assert worker.counters["rollout_fn.failed"] == 1
    # The failed call's samples count toward --generate-failure-limit; the next call's, generated, start it again.
    assert worker.failures.total == 2 * N and worker.failures.in_a_row == 0
    assert worker.failures.last_error == "raised RuntimeError('the first call fails')"
    assert worker.counters["rollout_fn.groups_unreturned"] == 2  # the failed call's groups: released, not sent
    assert set(worker.held.values()) == {0}  # every group leased was released exactly once, sent or not
    sent = [group_id for _, group_id, _ in worker.sent]
    assert sent[:2] == ["0:2", "0:3"] and "0:0" not in sent and "0:1" not in sent  # the failed call's: re-issued
    second_lease = list(worker.held)[1]
    for lease_id, _, samples in worker.sent[:2]:
        assert lease_id == second_lease and [s.reward for s in samples] == [1.0] * N
        assert all(s.token_versions.tolist() == [3] for s in samples)  # the engine's version when the call began
