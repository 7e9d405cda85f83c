"""Distillation teachers that are servers: the reward worker asks each sample's teacher to score its tokens.

A teacher server is an SGLang server (or ours, `tools.standins.sglang_server`, over the torch engine) of a model
with the student's tokenizer. One `/generate` call per group and teacher, in SGLang's batch form, with
`max_new_tokens: 0`, `return_logprob` and `logprob_start_len` at the last prompt token: SGLang then returns, per
sample, one `input_token_logprobs` entry per token from there on, the first without a value; the rest are the
teacher's log-probs of the response tokens, checked against the sample's own ids before they are kept. The
teacher scores at the rollout temperature, as slime's OPD reward function asks it to.

A teacher that cannot score (unreachable after the retries, an HTTP error, a malformed answer) fails the sample
with the teacher named; the buffer leaves it out and counts it, as it does a failed reward. Eval samples are
never scored: they are not trained.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import numpy as np

from actors.config.teachers import Teacher, teacher_of
from bus.schema import Sample

ATTEMPTS = 3  # a teacher server that restarts between two calls is asked again, not the sample failed at once
RETRY_PAUSE_S = 1.0


class TeacherError(RuntimeError):
    """A teacher server's answer could not be used; the message names the teacher and what was wrong."""


class TeacherScorer:
    """The run's teacher servers and the rule that picks each sample's teacher; one per reward worker."""

    def __init__(self, teachers: Mapping[str, Teacher], *, key: str | None, timeout_s: float,
                 temperature: float, retry_pause_s: float = RETRY_PAUSE_S) -> None:
        self.teachers = dict(teachers)
        self.retry_pause_s = retry_pause_s
        self.key = key
        self.timeout_s = timeout_s
        self.temperature = temperature
        self._session: aiohttp.ClientSession | None = None

    @property
    def has_servers(self) -> bool:
        return any(not teacher.in_learner for teacher in self.teachers.values())

    async def annotate(self, samples: Sequence[Sample]) -> list[Sample]:
        """`samples` with each server teacher's log-probs set; a sample its teacher could not score is failed."""
        by_teacher: dict[str, list[int]] = {}
        for index, sample in enumerate(samples):
            if sample.status == "failed":
                continue
            try:
                teacher = teacher_of(sample.metadata, self.teachers, self.key)
            except ValueError as error:
                _fail(sample, f"distillation: {error}")
                continue
            if not teacher.in_learner:
                by_teacher.setdefault(teacher.name, []).append(index)
        await asyncio.gather(*(self._score(self.teachers[name], [samples[i] for i in members])
                               for name, members in by_teacher.items()))
        return list(samples)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _score(self, teacher: Teacher, samples: list[Sample]) -> None:
        try:
            answer = await self._post(teacher, _scoring_request(samples, self.temperature))
            for sample, item in zip(samples, _items(answer, len(samples)), strict=True):
                sample.teacher_log_probs = response_log_probs(item, sample)
        except TeacherError as error:
            for sample in samples:
                _fail(sample, f"teacher {teacher.name!r} ({teacher.url}): {error}")

    async def _post(self, teacher: Teacher, payload: dict[str, Any]) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        last = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                await asyncio.sleep(self.retry_pause_s * attempt)
            try:
                async with self._session.post(f"{teacher.url}/generate", json=payload,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
                    body = await response.text()
                    if response.status < 400:
                        return _json(body)
                    last = f"HTTP {response.status}: {body[:200]}"
                    if response.status < 500 and response.status != 429:
                        break  # asking again will not change a refusal
            except asyncio.TimeoutError:
                last = f"no answer within {self.timeout_s} s (--opd-teacher-timeout)"
            except aiohttp.ClientError as error:
                last = f"{type(error).__name__}: {error}"
        raise TeacherError(last)


def _scoring_request(samples: Sequence[Sample], temperature: float) -> dict[str, Any]:
    return {
        "input_ids": [np.asarray(sample.tokens).tolist() for sample in samples],
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": [sample.prompt_tokens - 1 for sample in samples],
    }


def response_log_probs(item: Any, sample: Sample) -> np.ndarray:
    """The teacher's log-probs of `sample`'s response tokens from one `/generate` item, checked: one entry per
    token from the last prompt token on, the ids equal to the sample's, every value after the first finite."""
    try:
        entries = item["meta_info"]["input_token_logprobs"]
        values = [entry[0] for entry in entries[1:]]
        ids = [int(entry[1]) for entry in entries]
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise TeacherError(f"no input_token_logprobs in its answer ({type(error).__name__}: {error})") from None
    expected = np.asarray(sample.tokens)[sample.prompt_tokens - 1:].tolist()
    if ids != expected:
        raise TeacherError(f"scored {len(ids)} tokens that are not sample {sample.sample_id}'s last "
                           f"{len(expected)} (another tokenizer, or a truncated prompt?)")
    if not all(isinstance(value, int | float) and math.isfinite(value) for value in values):
        raise TeacherError(f"non-finite or missing log-probs for sample {sample.sample_id}")
    return np.asarray(values, dtype=np.float32)


def _items(answer: Any, count: int) -> list[Any]:
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != count:
        raise TeacherError(f"answered {len(items)} items for {count} samples")
    return items


def _json(body: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise TeacherError(f"the answer is not JSON: {body[:200]!r}") from None


def _fail(sample: Sample, reason: str) -> None:
    sample.status = "failed"
    sample.error = reason
