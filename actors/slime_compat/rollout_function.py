"""slime's ``--rollout-function-path``: a whole-rollout ``generate_rollout(args, rollout_id, data_source,
evaluation=False)`` driving a rollout worker.

slime calls that function once per rollout step with its data source and trains on the groups it returns. Here
each rollout worker calls it over and over (``rollout_id`` counts that worker's calls from 0), and the data source
it hands over leases prompt groups from the buffer: ``get_samples(n)`` returns groups the function put back with
``add_samples`` first (oldest first: slime's ``pop_first``; ``--buffer-filter-path`` chooses among the buffer's
finished groups instead, see ``buffer_filter``), then leases the rest, waiting for the buffer up to
``--lease-timeout``. Every returned group goes to the reward workers as one ``GeneratedGroup`` under the lease it
came from; a sample's reward that the function set is kept there. What a function takes and neither returns nor
puts back is given up: its lease expires and the buffer re-issues the group. Evaluation groups never reach the
function; the worker generates them itself, as without the flag.

The function runs on a daemon thread of its own (a plugin blocked for good never holds up the process's exit); an
``async def`` one runs on an event loop that thread keeps across calls, as slime's ``run`` helper does. Its data
source calls cross to the worker's event loop, where all the bookkeeping lives, so nothing here needs a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from actors.config import RunConfig
from actors.config.engines import http_engine_problem
from actors.slime_compat.args import build_args
from actors.slime_compat.data_source import (
    FLAG,
    GROUP_KEY,
    GroupSource,
    Held,
    LeasedDataSource,
    WorkerStopping,
    group_id_of,
)
from actors.slime_compat.plugins import accepted_kwargs
from actors.slime_compat.sample import Sample, to_wire
from bus.schema import Sample as WireSample
from policies.plugins import load_callable

ROLLOUT_BUFFER_CLIENT = "actors.slime_compat.rollout_buffer:generate_rollout"  # imported only when it runs

__all__ = ["FunctionThread", "RolloutFnEvalOutput", "RolloutFnTrainOutput", "RolloutFunctionRunner",
           "check_rollout_function", "flatten_output", "function_path", "sort_output", "wire_group"]



@dataclass
class RolloutFnTrainOutput:
    """What a slime rollout function may return for training (slime's fields): groups of samples, and metrics."""

    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """slime's evaluation output. Evaluation prompts here go through the rollout worker's own path, so a rollout
    function is never called with ``evaluation=True``; returning this from a training call is an error."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


class RolloutHost(GroupSource, Protocol):
    """The rest the runner needs of a rollout worker."""

    config: RunConfig
    engine: Any
    log: Any
    counters: Any

    def weights_too_old(self) -> bool: ...

    async def send_generated(self, lease_id: str, group_id: str, samples: list[WireSample]) -> None: ...

    async def generation_raised(self, item: str, error: Exception, *, samples: int) -> None: ...


def flatten_output(output: Any, *, path: str) -> list[Sample]:
    """The samples of what a rollout function returned (``RolloutFnTrainOutput`` or nested lists), in order."""
    if isinstance(output, RolloutFnEvalOutput) or (hasattr(output, "data") and not hasattr(output, "samples")):
        raise TypeError(f"{FLAG} {path} returned an evaluation output from a training call (evaluation=False)")
    samples = output.samples if hasattr(output, "samples") else output
    if not isinstance(samples, list):
        raise TypeError(f"{FLAG} {path} returned {type(output).__name__}; expected list[list[Sample]] or "
                        "RolloutFnTrainOutput")

    def walk(items: list[Any]) -> Iterator[Sample]:
        for item in items:
            if isinstance(item, list):
                yield from walk(item)
            elif isinstance(item, Sample):
                yield item
            else:
                raise TypeError(f"{FLAG} {path} returned a {type(item).__name__} among its samples; expected "
                                "actors.slime_compat.Sample")

    return list(walk(samples))


def sort_output(samples: list[Sample], held: Mapping[str, Held], *, path: str
                ) -> tuple[list[tuple[Held, list[Sample]]], list[str]]:
    """Returned samples by group: the complete groups to send, and a message per group (or stray sample) that
    cannot be sent. A group must come back whole: exactly ``n_samples_per_prompt`` samples."""
    grouped: dict[str, list[Sample]] = {}
    problems = []
    untagged = 0
    for sample in samples:
        group_id = group_id_of(sample)
        if group_id is None:
            untagged += 1
        else:
            grouped.setdefault(group_id, []).append(sample)
    if untagged:
        problems.append(f"{FLAG} {path}: {untagged} returned sample(s) came from no group of data_source.get_samples "
                        "(the group tag in sample.metadata is gone), so no prompt group to send them under")
    ready = []
    for group_id, members in grouped.items():
        entry = held.get(group_id)
        if entry is None:
            problems.append(f"{FLAG} {path}: group {group_id} was returned but is not held (returned twice, or "
                            "from an earlier call that gave it up)")
        elif len(members) != entry.group.n_samples:
            problems.append(f"{FLAG} {path}: group {group_id} came back with {len(members)} samples; "
                            f"n_samples_per_prompt is {entry.group.n_samples}, so it is not sent (its lease expires "
                            "and the buffer re-issues it)")
        else:
            ready.append((entry, members))
    return ready, problems


def wire_group(held: Held, samples: list[Sample], *, start_version: int) -> list[WireSample]:
    """The group's samples on the wire, our group tag stripped."""
    version = min(start_version, held.version)
    return [to_wire(dataclasses.replace(sample, metadata={k: v for k, v in sample.metadata.items() if k != GROUP_KEY}),
                    held.group, index, start_version=version)
            for index, sample in enumerate(samples)]


def function_path(config: RunConfig) -> str | None:
    """The rollout function the run's workers call: ``--rollout-function-path``, else the rollout-buffer client
    when ``--rollout-buffer-url`` is given (slime's own client reads that flag), else None."""
    if config.rollout.rollout_function_path:
        return config.rollout.rollout_function_path
    return ROLLOUT_BUFFER_CLIENT if config.agent.rollout_buffer_url else None


def check_rollout_function(config: RunConfig) -> None:
    """Refuse at start-up what cannot work with ``--rollout-function-path`` (before the engine loads)."""
    path = function_path(config)
    if not path:
        return
    what = ("--rollout-buffer-url: the service" if path == ROLLOUT_BUFFER_CLIENT
            else f"{FLAG} {path}: a slime rollout function")
    problem = http_engine_problem(config.engine.rollout_engine, what)
    if problem is not None:
        raise ValueError(problem)
    if config.rollout.custom_generate_function_path:
        raise ValueError(f"{FLAG} {path} replaces generation as a whole, so --custom-generate-function-path "
                         f"{config.rollout.custom_generate_function_path} would never be called; call your generate "
                         "function from the rollout function instead")


class FunctionThread:
    """One daemon thread making every call of the function, with one event loop kept for ``async def`` ones."""

    def __init__(self, name: str) -> None:
        self.calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.calls.put((call, future))
        return future

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        while True:
            call, future = self.calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
                if inspect.isawaitable(result):
                    result = loop.run_until_complete(result)
            except Exception as error:
                future.set_exception(error)
            except BaseException as error:  # SystemExit in a plugin must not end the worker's loop
                future.set_exception(RuntimeError(f"rollout function raised {error!r}"))
            else:
                future.set_result(result)


class RolloutFunctionRunner:
    """A rollout worker's story under ``--rollout-function-path``: call the function, send what it returns."""

    def __init__(self, worker: RolloutHost, fn: Callable[..., Any], path: str) -> None:
        config = worker.config
        url = getattr(worker.engine, "url", None)
        if url is None:
            raise ValueError(f"{FLAG} {path}: the rollout engine ({config.engine.rollout_engine}) has no HTTP server "
                             "for a slime rollout function to call")
        self.worker, self.fn, self.path = worker, fn, path
        self.args = build_args(config, server_url=url)
        vars(self.args).setdefault("rollout_global_dataset", True)  # slime's generate_rollout asserts it
        vars(self.args).setdefault("over_sampling_batch_size", config.rollout.rollout_batch_size)
        vars(self.args).setdefault("rollout_worker_id", getattr(worker, "actor_id", None))
        self.source = LeasedDataSource(worker, asyncio.get_running_loop(), args=self.args, path=path,
                                       lease_timeout=config.buffer.lease_timeout)
        self.call_kwargs = accepted_kwargs(fn, {"evaluation": False})  # slime passes it only to functions that take it
        self.thread = FunctionThread(name=f"rollout-function:{path}")
        self.reported: dict[str, float] = {}

    @classmethod
    def load(cls, worker: RolloutHost) -> RolloutFunctionRunner:
        """The runner for ``config.rollout.rollout_function_path``; call on the worker's loop after its engine (the
        worker has already run ``check_rollout_function``, before loading the engine)."""
        path = function_path(worker.config) or ""
        fn = load_callable(path, what=FLAG)
        return cls(worker, fn, path)

    async def run(self) -> None:
        """call → send → call again, for as long as the run lasts."""
        worker, rollout_id = self.worker, 0
        while not worker.stopping:
            if worker.weights_too_old():
                await asyncio.sleep(0.2)
                continue
            start = self.source.version = worker.engine.version
            self.source.rollout_id = rollout_id
            try:
                output = await self._call(rollout_id)
                await self._send(flatten_output(output, path=self.path), start)
                self._report(getattr(output, "metrics", None))
            except WorkerStopping:
                return
            except Exception as error:
                if worker.stopping:
                    return
                # Leases of what the call held expire and the buffer re-issues those groups. The samples it held (one
                # if none) count toward --generate-failure-limit, which ends a run whose function always raises.
                worker.counters["rollout_fn.failed"] += 1
                held = sum(entry.group.n_samples for entry in self.source.held.values())
                await worker.generation_raised(f"rollout function call {rollout_id}", error, samples=held)
                await asyncio.sleep(1.0)
            finally:
                await self._give_up(self.source.abandoned(), rollout_id)
            rollout_id += 1

    async def _call(self, rollout_id: int) -> Any:
        future = self.thread.submit(lambda: self.fn(self.args, rollout_id, self.source, **self.call_kwargs))
        self.worker.counters["rollout_fn.calls"] += 1
        return await asyncio.wrap_future(future)

    async def _send(self, samples: list[Sample], start_version: int) -> None:
        worker = self.worker
        ready, problems = sort_output(samples, self.source.held, path=self.path)
        for problem in problems:
            worker.counters["rollout_fn.groups_invalid"] += 1
            worker.log.error("rollout function output not sent", path=self.path, problem=problem)
        for held, members in ready:
            self.source.settle(held.group.group_id)
            try:
                wire = wire_group(held, members, start_version=start_version)
                await worker.send_generated(held.lease_id, held.group.group_id, wire, is_eval=held.group.is_eval,
                                            eval_set=held.group.eval_set)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                worker.counters["groups.failed"] += 1
                worker.log.exception("rollout function group not sent", path=self.path, group=held.group.group_id,
                                     error=repr(error))
            finally:
                await worker.release(held.lease_id, held.group)

    async def _give_up(self, abandoned: list[Held], rollout_id: int) -> None:
        if abandoned and not self.worker.stopping:
            self.worker.counters["rollout_fn.groups_unreturned"] += len(abandoned)
            self.worker.log.warning("rollout function neither returned nor put back groups; their leases expire",
                                    path=self.path, rollout_id=rollout_id,
                                    groups=[held.group.group_id for held in abandoned])
        for held in abandoned:
            await self.worker.release(held.lease_id, held.group)

    def _report(self, metrics: Any) -> None:
        if isinstance(metrics, dict):
            self.reported.update({f"rollout_fn.{key}": float(value) for key, value in metrics.items()
                                  if isinstance(value, (int, float)) and not isinstance(value, bool)})

    def metrics(self) -> dict[str, float]:
        """The numeric metrics of the function's last ``RolloutFnTrainOutput``, and the groups it has put back."""
        return {**self.reported, "rollout_fn.groups_put_back": float(len(self.source.pending))}

