"""slime's rollout-buffer service (--rollout-buffer-url): our client (actors/slime_compat/rollout_buffer.py) against
the stand-in service over real HTTP, filling slots leased from a real BufferCore; the test writes the trajectories
as a generator of the service would, and the run's settings that cannot train on them are refused."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from actors.config import build_config
from actors.slime_compat.args import build_args
from actors.slime_compat.data_source import LeasedDataSource
from actors.slime_compat.rollout_buffer import RolloutBufferRollout, ServiceError
from actors.slime_compat.rollout_function import check_rollout_function, flatten_output, sort_output, wire_group
from tests.actors.test_rollout_function import B, N, make_source
from tests.support.http_apps import served
from tools.standins.rollout_buffer_service import RolloutBufferService


@pytest.fixture
def service() -> Iterator[tuple[RolloutBufferService, str]]:
    """The stand-in service on a port of its own, served from its own event loop thread."""
    service = RolloutBufferService()
    with served(service.app()) as url:
        yield service, url


@pytest.fixture
def source(loop: asyncio.AbstractEventLoop) -> LeasedDataSource:
    """The data source a rollout function gets, leasing from a real BufferCore on the worker's loop (`loop`)."""
    return make_source(loop, max_staleness=8)[0]


@dataclass
class Setup:
    """The stand-in service and what the client's args are built from."""

    stand_in: RolloutBufferService
    url: str
    model: Path
    tmp_path: Path

    def args(self, *, worker: str = "rollout-0-0", **settings) -> SimpleNamespace:
        prompts = self.tmp_path / "prompts.jsonl"
        prompts.write_text("")  # the service's to read; its generator has nothing to do, the test writes instead
        config = build_config({"hf_checkpoint": str(self.model), "prompt_data": str(prompts),
                               "rollout_engine": "sglang", "rollout_buffer_url": self.url,
                               "off_policy_correction": "none", "n_samples_per_prompt": N, "rollout_batch_size": B,
                               "loss_mask_type": "qwen", "rollout_buffer_timeout": 10.0, **settings})
        args = build_args(config, server_url="http://10.0.0.7:30000")
        args.rollout_worker_id = worker  # as RolloutFunctionRunner sets it
        return args


@pytest.fixture
def setup(service: tuple[RolloutBufferService, str], tiny_model_path: Path, tmp_path: Path) -> Setup:
    return Setup(*service, tiny_model_path, tmp_path)


def trajectory(instance: int, member: int, *, answer: str = "5", reward: float = 1.0, **extra) -> dict:
    return {"uid": f"u{instance}.{member}", "instance_id": instance, "reward": reward,
            "messages": [{"role": "user", "content": f"{instance}+1="}, {"role": "assistant", "content": answer}],
            "extra_info": {"label": str(instance + 1), "timestamp": str(time.time()), "finish_reason": "stop",
                           **extra}}


def write(url: str, *records: dict) -> None:
    for record in records:
        # json.dumps writes NaN as Python's generators do (requests' json= refuses it)
        requests.post(f"{url}/buffer/write", data=json.dumps(record), timeout=10).raise_for_status()


def generator(stand_in: RolloutBufferService, url: str, *records: dict) -> threading.Thread:
    """The service's generator, played by the test: it writes `records` once the service is started (a start
    empties the buffer, as slime's does)."""

    def run() -> None:
        deadline = time.monotonic() + 20
        while not stand_in.starts and time.monotonic() < deadline:
            time.sleep(0.01)
        write(url, *records)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_service_is_started_and_its_scored_groups_fill_the_leased_slots(source, setup: Setup) -> None:
    from transformers import AutoTokenizer

    stand_in, url = setup.stand_in, setup.url
    args = setup.args(rollout_task_type="math")
    source.version = 3
    generator(stand_in, url, trajectory(9, 0),  # an incomplete group: kept for a later batch
              *(trajectory(i, m, reward=float(m), finish_reason="length" if (i, m) == (1, 1) else "stop")
                for i in range(B) for m in range(N)))

    output = RolloutBufferRollout(poll_s=0.05)(args, 0, source)

    (start,) = stand_in.starts
    assert (start["task_type"], start["remote_engine_url"], start["num_repeat_per_sample"]) == (
        "math", "http://10.0.0.7:30000", str(N))
    assert start["input_file"] == args.prompt_data and start["sampling_params"]["max_tokens"] == 32
    tokenizer = AutoTokenizer.from_pretrained(setup.model)
    samples = flatten_output(output, path="client")
    ready, problems = sort_output(samples, source.held, path="client")
    assert problems == [] and len(ready) == B
    filled = sorted((s for _, group in ready for s in group), key=lambda s: s.metadata["uid"])
    assert [s.metadata["uid"] for s in filled] == [f"u{i}.{m}" for i in range(B) for m in range(N)]
    for held, group in ready:
        assert len({s.metadata["instance_id"] for s in group}) == 1  # one of the service's groups per slot
        for sample, wire in zip(group, wire_group(held, group, start_version=3), strict=True):
            messages = [*sample.prompt, {"role": "assistant", "content": "5"}]
            assert tokenizer.decode(sample.tokens) == tokenizer.apply_chat_template(messages, tokenize=False)
            assert tokenizer.decode(sample.tokens[-sample.response_length:]) == "5<|im_end|>\n"
            assert wire.prompt == sample.prompt and wire.label == sample.label  # the service's task, not the slot's
            assert wire.reward == float(sample.metadata["uid"].endswith(".1"))  # scored by the service
            assert wire.rollout_log_probs is None and wire.loss_mask.all()
            assert wire.token_versions.tolist() == [3] * wire.response_length
            expected = "truncated" if sample.metadata["uid"] == "u1.1" else "completed"
            assert wire.status == expected
    assert output.metrics["rollout_buffer/failed_requests"] == 0


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_bad_trajectory_is_a_failed_sample_that_says_why(source, setup: Setup) -> None:
    stand_in, url = setup.stand_in, setup.url
    args = setup.args(rollout_batch_size=1)
    no_turn = trajectory(0, 1)
    no_turn["messages"] = no_turn["messages"][:1]
    generator(stand_in, url, trajectory(0, 0, reward=float("nan")), no_turn)
    output = RolloutBufferRollout(poll_s=0.05)(args, 0, source)
    reasons = sorted(s.metadata["rollout_buffer_error"] for s in flatten_output(output, path="client"))
    assert reasons == ["trajectory 'u0.0': reward nan is not a finite number",
                       "trajectory 'u0.1' has no assistant message to train on"]
    assert all(s.status.value == "failed" for s in flatten_output(output, path="client"))
    assert output.metrics["rollout_buffer/dropped_bad_trajectory"] == 2


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_failed_reads_are_retried_as_fetch_trajectory_retry_times_says(source, setup: Setup) -> None:
    stand_in, url = setup.stand_in, setup.url
    write(url, trajectory(0, 0), trajectory(0, 1))
    stand_in.fail_reads = 2
    args = setup.args(rollout_batch_size=1, fetch_trajectory_retry_times=3, worker="rollout-1")
    output = RolloutBufferRollout(poll_s=0.05)(args, 0, source)
    assert output.metrics["rollout_buffer/failed_requests"] == 2

    stand_in.fail_reads = 5
    args = setup.args(rollout_batch_size=1, fetch_trajectory_retry_times=2, worker="rollout-1")
    with pytest.raises(ServiceError, match=r"2 failed request\(s\) .*retry-times 2\); the last: .*"
                                           r"/get_rollout_data: HTTP 500"):
        RolloutBufferRollout(poll_s=0.05)(args, 1, source)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_batch_the_service_does_not_fill_in_time_fails_naming_the_wait(source, setup: Setup) -> None:
    stand_in, url = setup.stand_in, setup.url
    args = setup.args(rollout_buffer_timeout=0.5, worker="rollout-1")
    write(url, trajectory(0, 0))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0 of 3 complete groups of 2 trajectories within "
                                           r"--rollout-buffer-timeout 0.5s \(partial groups: 1\)"):
        RolloutBufferRollout(poll_s=0.05)(args, 0, source)
    assert time.monotonic() - started < 5
    assert stand_in.starts == []  # only rollout-0-0 starts the service: a second start would reset its buffer


@pytest.mark.unit
def test_settings_that_need_the_engines_log_probs_are_refused_with_the_service() -> None:
    url = {"rollout_buffer_url": "http://svc:8889", "rollout_engine": "sglang"}
    with pytest.raises(ValueError, match="--off-policy-correction tis: the rollout-buffer service returns chat "
                                         "messages and rewards, no engine log-probs"):
        build_config(url)  # our default correction, TIS, reads mu
    with pytest.raises(ValueError, match="--use-rollout-logprobs"):
        build_config({**url, "use_rollout_logprobs": True})
    with pytest.raises(ValueError, match="expected the service's http"):
        build_config({**url, "rollout_buffer_url": "svc:8889", "off_policy_correction": "none"})
    with pytest.raises(ValueError, match=r"--rollout-buffer-url: the service calls the engine over HTTP .* "
                                         "--rollout-engine torch serves none"):
        check_rollout_function(build_config({**url, "rollout_engine": "torch", "off_policy_correction": "none"}))
    check_rollout_function(build_config({**url, "off_policy_correction": "none"}))
