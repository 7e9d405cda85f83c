"""The client of slime's rollout-buffer service (`--rollout-buffer-url`): an agent framework of the user's that
generates trajectories through our engine and scores them itself, as slime's `slime_plugins/rollout_buffer` runs it.

The protocol (slime's `buffer.py` and its `rollout_buffer_example.py`): the trainer posts `/start_rollout` once,
with the engine's URL (an OpenAI-compatible server the service's generators call), the task type (which of its
generators runs), the prompt file and the sampling settings; the generators write each finished trajectory to the
service (`/buffer/write`); the trainer polls `/get_rollout_data`, which answers `success: false` until some groups
are complete, then every complete group's trajectories: `{uid, instance_id, messages, reward, extra_info}`, a
group being the trajectories of one `instance_id`.

Here that is a rollout function run by `rollout_function.RolloutFunctionRunner`, so it fills prompt groups leased
from our buffer: the leases are the slots of a batch (the staleness gate admits them, the batch counts them), and
each slot is filled with one group of the service's (its own prompt, label and metadata, its `instance_id` and
`uid`s in the metadata); the prompt file is the service's to read. Each trajectory becomes a sample as slime makes
it: the conversation tokenised through the chat template and cut by `--loss-mask-type` (the assistant turns
trained on), its reward the service's (the reward workers keep a reward that is set: nothing is scored twice),
`truncated` when its `extra_info.finish_reason` is "length". The messages carry no engine log-probs and no weight
versions: the learner computes pi_old (`actors/config/rollout_buffer.py` refuses what needs mu), and every token
gets the version the engine served when the trajectory was written (its `timestamp`), as far as this worker saw
it: the call start at or before that time, else the previous call's.

A trajectory that cannot become a sample (a required key missing, messages that are not a chat, no assistant turn
to train on, a reward that is not a finite number, a template that fails) is a failed sample of its group with the
reason in its metadata and the batch's metrics (`--failed-sample-policy` decides the group). Every wait has a
deadline: a request's own timeout, `--fetch-trajectory-retry-times` failed requests per batch, and
`--rollout-buffer-timeout` for the batch's groups; a batch that fails gives its slots back to the buffer.
With several rollout workers, the first (`rollout-0-0`) starts the service with its engine's URL (the service
takes one, slime gives it its router's) and every worker fetches.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from actors.slime_compat.rollout_function import ROLLOUT_BUFFER_CLIENT as BUILTIN
from actors.slime_compat.rollout_function import RolloutFnTrainOutput
from actors.slime_compat.sample import Sample
from actors.slime_compat.state import load_tokenizer

__all__ = ["BUILTIN", "SLIME_EXAMPLE", "RolloutBufferRollout", "ServiceClient", "TrajectoryStore", "generate_rollout",
           "start_payload", "to_sample"]

SLIME_EXAMPLE = "slime_plugins.rollout_buffer.rollout_buffer_example.generate_rollout"  # slime's client, spelled out
REQUIRED = ("uid", "instance_id", "messages", "reward", "extra_info")  # what slime's client requires of a record
STARTER = "rollout-0-0"  # the head node's first rollout worker: it posts /start_rollout
REQUEST_TIMEOUT_S = 30.0
POLL_S = 1.0  # between two /get_rollout_data that brought too few groups


class ServiceError(RuntimeError):
    """The rollout-buffer service failed a request, or too many."""


class BadTrajectory(ValueError):
    """A record that cannot become a sample; the message is the reason."""


def start_payload(args: Any, *, skip_instance_ids: list[Any]) -> dict[str, Any]:
    """`/start_rollout`'s body as slime's client sends it (numbers as strings where slime sends strings)."""
    return {
        "num_process": str(getattr(args, "rollout_num_process", 100)),
        "num_epoch": str(getattr(args, "num_epoch", None) or 3),
        "remote_engine_url": f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        "remote_buffer_url": args.rollout_buffer_url,
        "task_type": args.rollout_task_type,
        "input_file": args.prompt_data,
        "num_repeat_per_sample": str(args.n_samples_per_prompt),
        "max_tokens": str(args.rollout_max_response_len),
        "sampling_params": {"max_tokens": args.rollout_max_response_len, "temperature": args.rollout_temperature,
                            "top_p": args.rollout_top_p},
        "tokenizer_path": args.hf_checkpoint,
        "skip_instance_ids": skip_instance_ids,
    }


class ServiceClient:
    """The service's two calls over HTTP, each with a timeout; an error names the URL and what went wrong."""

    def __init__(self, url: str, *, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout

    def start(self, payload: Mapping[str, Any]) -> Any:
        return self._post("/start_rollout", payload)

    def fetch(self) -> tuple[list[Any], dict[str, Any]]:
        """One `/get_rollout_data`: the trajectories it gave (none while no group is complete) and its meta info."""
        reply = self._post("/get_rollout_data", {})
        if not isinstance(reply, dict) or "success" not in reply:
            raise ServiceError(f"{self.url}/get_rollout_data answered {str(reply)[:200]!r}; expected a JSON object "
                               "with 'success' and 'data'")
        data = reply.get("data") or {}
        records, meta = (data.get("data", []), data.get("meta_info") or {}) if isinstance(data, dict) else (data, {})
        if not isinstance(records, list):
            raise ServiceError(f"{self.url}/get_rollout_data: data.data is {type(records).__name__}, expected a list "
                               "of trajectories")
        return (records if reply["success"] else []), (meta if isinstance(meta, dict) else {})

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            raise ServiceError(f"{self.url}{path}: HTTP {error.code} {error.read()[:200]!r}") from None
        except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
            raise ServiceError(f"{self.url}{path}: {getattr(error, 'reason', error)} (timeout {self.timeout:g}s)"
                               ) from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ServiceError(f"{self.url}{path}: the answer is not JSON ({error.msg}): {text[:200]!r}") from None


def _timestamp(record: Mapping[str, Any]) -> float | None:
    """When the service's generator wrote the trajectory (slime's writes `timestamp` into extra_info)."""
    extra = record.get("extra_info")
    for value in (record.get("timestamp"), extra.get("timestamp") if isinstance(extra, dict) else None):
        try:
            return float(value) if value is not None else None
        except (TypeError, ValueError):
            continue
    return None


class TrajectoryStore:
    """The service's trajectories by `instance_id` until a group of `group_size` is complete, and the complete
    groups until a batch takes them (newest first, as slime's client selects them). Beyond `keep` complete groups
    the oldest are dropped (`dropped` counts them): they would only grow staler."""

    def __init__(self, group_size: int, *, keep: int) -> None:
        self.group_size, self.keep = group_size, keep
        self.partial: dict[str, list[dict[str, Any]]] = {}
        self.complete: list[list[dict[str, Any]]] = []
        self.dropped: Counter[str] = Counter()

    def add(self, records: list[Any]) -> None:
        for record in records:
            if not isinstance(record, dict) or "instance_id" not in record:
                self.dropped["no_instance_id"] += 1  # no group to put it in: not even a failed sample
                continue
            members = self.partial.setdefault(str(record["instance_id"]), [])
            members.append(record)
            if len(members) == self.group_size:
                self.complete.append(self.partial.pop(str(record["instance_id"])))
        self.complete.sort(key=lambda group: max(_timestamp(r) or 0.0 for r in group))
        while len(self.complete) > self.keep:
            self.complete.pop(0)
            self.dropped["surplus_group"] += 1

    def take(self, n: int) -> list[list[dict[str, Any]]]:
        """Up to `n` complete groups, the newest."""
        taken = self.complete[-n:] if n else []
        del self.complete[len(self.complete) - len(taken):]
        return taken


def to_sample(record: Any, *, tokenizer: Any, mask_type: str, version: int) -> Sample:
    """One trajectory as slime's client makes it a sample; `BadTrajectory` says why it cannot be one."""
    from actors.data.loss_masks import multi_turn_tokens

    if not isinstance(record, dict):
        raise BadTrajectory(f"a trajectory is a JSON object, got {type(record).__name__}")
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise BadTrajectory(f"trajectory {record.get('uid')!r} lacks {', '.join(missing)}")
    messages, extra = record["messages"], record["extra_info"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise BadTrajectory(f"trajectory {record['uid']!r}: messages must be a list of chat messages with 'role'")
    if not isinstance(extra, dict):
        raise BadTrajectory(f"trajectory {record['uid']!r}: extra_info must be an object")
    reward = record["reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise BadTrajectory(f"trajectory {record['uid']!r}: reward {reward!r} is not a finite number")
    first_turn = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first_turn is None:
        raise BadTrajectory(f"trajectory {record['uid']!r} has no assistant message to train on")
    try:
        tokens, mask = multi_turn_tokens(tokenizer, messages, mask_type=mask_type)
    except Exception as error:  # the chat template's own error on these messages
        raise BadTrajectory(f"trajectory {record['uid']!r}: the chat template failed: {error}") from None
    if 1 not in mask:
        raise BadTrajectory(f"trajectory {record['uid']!r}: its assistant turns have no tokens to train on")
    prompt_tokens = mask.index(1)
    response_length = len(tokens) - prompt_tokens
    metadata = {key: value for key, value in extra.items() if key != "messages"}  # slime's generator repeats them
    finish = extra.get("finish_reason", record.get("finish_reason"))
    return Sample(
        prompt=messages[:first_turn], tokens=list(tokens), response_length=response_length,
        response=tokenizer.decode(tokens[prompt_tokens:]), label=extra.get("label"), reward=float(reward),
        loss_mask=list(mask[prompt_tokens:]), token_versions=[version] * response_length,
        status=Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED,
        metadata={**metadata, "instance_id": record["instance_id"], "uid": record["uid"]},
    )


class RolloutBufferRollout:
    """slime's `generate_rollout(args, rollout_id, data_source, evaluation=False)` over the service. One per
    rollout worker process (the module's `generate_rollout`): it holds whether the service was started and the
    trajectories fetched but not yet used."""

    def __init__(self, *, poll_s: float = POLL_S, clock: Callable[[], float] = time.time) -> None:
        self.poll_s, self.clock = poll_s, clock
        self.started = False
        self.store: TrajectoryStore | None = None
        self.versions: list[tuple[float, int]] = []  # (wall time of a call's start, the engine's version then)

    def __call__(self, args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
                 ) -> RolloutFnTrainOutput:
        if evaluation:
            raise NotImplementedError("the rollout-buffer service generates training trajectories only")
        if not args.rollout_buffer_url:
            raise ValueError(f"{BUILTIN} is the rollout-buffer client: it needs --rollout-buffer-url")
        client = ServiceClient(args.rollout_buffer_url)
        self.versions.append((self.clock(), int(getattr(data_source, "version", 0))))
        if self.store is None:
            self.store = TrajectoryStore(args.n_samples_per_prompt, keep=2 * args.rollout_batch_size)
        deadline = time.monotonic() + args.rollout_buffer_timeout
        failures: list[str] = []
        if not self.started and getattr(args, "rollout_worker_id", STARTER) == STARTER:
            self._until(lambda: client.start(start_payload(args, skip_instance_ids=[])), args, failures, deadline)
            self.started = True
        slots = data_source.get_samples(args.rollout_batch_size)
        groups = self._fetch(client, len(slots), args, failures, deadline)
        dropped: Counter[str] = Counter()
        tokenizer = load_tokenizer(args.hf_checkpoint)
        for slot, group in zip(slots, groups, strict=True):
            for sample, record in zip(slot, group, strict=True):
                self._fill(sample, record, tokenizer, args.loss_mask_type, dropped)
        dropped += self.store.dropped
        metrics = {f"rollout_buffer/dropped_{reason}": float(n) for reason, n in dropped.items()}
        self.store.dropped.clear()
        return RolloutFnTrainOutput(samples=slots, metrics={**metrics, "rollout_buffer/failed_requests":
                                                            float(len(failures))})

    def _fetch(self, client: ServiceClient, n: int, args: Any, failures: list[str], deadline: float
               ) -> list[list[dict[str, Any]]]:
        """`n` complete groups, polling the service until they are there or the deadline passes."""
        assert self.store is not None
        while len(self.store.complete) < n:
            records, _ = self._until(client.fetch, args, failures, deadline)
            self.store.add(records)
            if len(self.store.complete) >= n:
                break
            if time.monotonic() + self.poll_s > deadline:
                raise TimeoutError(f"--rollout-buffer-url {client.url}: {len(self.store.complete)} of {n} complete "
                                   f"groups of {args.n_samples_per_prompt} trajectories within "
                                   f"--rollout-buffer-timeout {args.rollout_buffer_timeout:g}s (partial groups: "
                                   f"{len(self.store.partial)}); is the service's {args.rollout_task_type!r} "
                                   "generator running and reaching the engine?")
            time.sleep(self.poll_s)
        return self.store.take(n)

    def _until(self, request: Callable[[], Any], args: Any, failures: list[str], deadline: float) -> Any:
        """`request`'s answer, retried while --fetch-trajectory-retry-times and the deadline allow."""
        limit = args.fetch_trajectory_retry_times
        while True:
            try:
                return request()
            except ServiceError as error:
                failures.append(str(error))
            if (limit != -1 and len(failures) >= limit) or time.monotonic() + self.poll_s > deadline:
                raise ServiceError(f"{len(failures)} failed request(s) to the rollout-buffer service "
                                   f"(--fetch-trajectory-retry-times {limit}); the last: {failures[-1]}")
            time.sleep(self.poll_s)

    def _fill(self, slot: Sample, record: Any, tokenizer: Any, mask_type: str, dropped: Counter[str]) -> None:
        """`slot` (a leased group's sample) becomes the trajectory's sample, or a failed sample saying why."""
        keep = {key: value for key, value in slot.metadata.items() if key.startswith("_slipstream")}  # its group tag
        try:
            sample = to_sample(record, tokenizer=tokenizer, mask_type=mask_type, version=self._version_at(record))
        except BadTrajectory as error:
            dropped["bad_trajectory"] += 1
            slot.status, slot.reward = Sample.Status.FAILED, 0.0
            slot.metadata = {**keep, "rollout_buffer_error": str(error)}
            return
        for name in ("prompt", "tokens", "response", "response_length", "label", "reward", "loss_mask",
                     "token_versions", "status"):
            setattr(slot, name, getattr(sample, name))
        slot.metadata = {**sample.metadata, **keep}

    def _version_at(self, record: Mapping[str, Any]) -> int:
        """The engine's version when the trajectory was written, as this worker saw it (module docstring)."""
        stamp = _timestamp(record)
        if stamp is None:
            return self.versions[-2][1] if len(self.versions) > 1 else self.versions[0][1]
        seen = [version for at, version in self.versions if at <= stamp]
        return seen[-1] if seen else self.versions[0][1]


generate_rollout = RolloutBufferRollout()
