"""Turning one prompt group into samples: the default single-turn generation, and what every generate function
is given (`RolloutContext`) and builds samples with (`make_sample`). Which one a run uses: `actors.rollout.choice`.

A custom generate function (`--custom-generate-function-path pkg.mod:fn`) has the signature
`async def fn(context: RolloutContext, group: PromptGroup) -> list[Sample]` and may call the engine several
times (multi-turn, tool calls). It builds samples with `make_sample`, passing a loss mask that zeroes the
tokens the policy did not produce (tool outputs), and the versions/log-probs of the tokens it did.
A slime-style `async def generate(args, sample, sampling_params) -> Sample` is detected by its signature and
adapted (`actors.slime_compat`); it reaches the engine over HTTP, so it needs `--rollout-engine sglang`.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from actors.config import RunConfig
from actors.data.prompt_tokens import encode_prompt
from bus.schema import STATUS_BY_FINISH, PromptGroup, Sample
from engines.inference.base import (
    ContextFull,
    GenerateOutput,
    GenerateRequest,
    InferenceEngine,
    RoutedExperts,
    SamplingParams,
)

GenerateFunction = Callable[["RolloutContext", PromptGroup], Awaitable[list[Sample]]]
_request_ids = itertools.count()


@runtime_checkable
class Tokenizer(Protocol):
    """What the rollout path uses of a tokenizer: a Hugging Face tokenizer satisfies it, and so does any small
    stand-in (tools/sim/pipeline.py), so an engine factory never has to pull in transformers to be typed."""

    eos_token_id: int | None

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, Any]:
        """`{"input_ids": [...]}` for one text."""

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                            tokenize: bool, **kwargs: Any) -> Any:
        """Token ids of a chat (a list, or a mapping with "input_ids")."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...


@dataclass
class RolloutContext:
    engine: InferenceEngine
    tokenizer: Tokenizer
    config: RunConfig
    worker_id: str
    engine_calls: int = field(default=0, init=False)  # sampling-params requests so far for this group
    # Each time the context cap left fewer new tokens than asked, what it left: the worker says so (a response cut
    # to a token or two by a long prompt trains as a truncated answer, and nothing else would show why).
    context_cuts: list[str] = field(default_factory=list, init=False)

    def sampling_params(self, group: PromptGroup, *, n: int | None = None,
                        prompt_tokens: int | None = None) -> SamplingParams:
        """The group's sampling; eval groups use the --eval-* values where given. With `prompt_tokens`, max new
        tokens shrink to fit the context cap (`NoRoomError` when the prompt alone fills it)."""
        config, rollout, evaluation = self.config, self.config.rollout, self.config.eval
        is_eval = group.is_eval
        eval_greedy = is_eval and evaluation.eval_temperature == 0
        top_p = evaluation.eval_top_p if is_eval and evaluation.eval_top_p is not None else rollout.rollout_top_p
        top_k = evaluation.eval_top_k if is_eval and evaluation.eval_top_k is not None else rollout.rollout_top_k
        max_new = rollout.rollout_max_response_len
        if is_eval and evaluation.eval_max_response_len is not None:
            max_new = evaluation.eval_max_response_len
        if prompt_tokens is not None:
            max_new = self.fit_context(group, prompt_tokens, max_new)
        return SamplingParams(
            temperature=evaluation.eval_temperature if is_eval else rollout.rollout_temperature,
            top_p=1.0 if eval_greedy else top_p,
            top_k=0 if eval_greedy else top_k,
            max_new_tokens=max_new,
            stop=tuple(config.rollout.rollout_stop),
            stop_token_ids=tuple(rollout.rollout_stop_token_ids),
            n=group.n_samples if n is None else n,
            seed=self.request_seed(group),
        )

    def request_seed(self, group: PromptGroup) -> int:
        """The sampling seed of this group's next engine call, from --seed, the group and the call's position.

        Keyed by the group, not by the worker or the clock, so the same run seed draws the same samples from the
        same weights whichever worker leases the group and whatever else the engine is batching; a multi-turn
        generate's later calls get seeds of their own. A re-issued group draws as it would have the first time.
        """
        self.engine_calls += 1
        key = f"{self.config.seed}/{group.group_id}/{self.engine_calls}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

    def context_limit(self, group: PromptGroup) -> tuple[str, int | None]:
        """The flag and value capping prompt + response tokens for this group (eval falls back to rollout's)."""
        if group.is_eval and self.config.eval.eval_max_context_len is not None:
            return "--eval-max-context-len", self.config.eval.eval_max_context_len
        return "--rollout-max-context-len", self.config.rollout.rollout_max_context_len

    def fit_context(self, group: PromptGroup, prompt_tokens: int, max_new_tokens: int) -> int:
        """`max_new_tokens` cut to what the context cap leaves after the prompt."""
        flag, limit = self.context_limit(group)
        if limit is None:
            return max_new_tokens
        room = limit - prompt_tokens
        if room < 1:
            raise NoRoomError(f"prompt of {prompt_tokens} tokens leaves no room for a response under {flag} "
                              f"{limit}")
        if room < max_new_tokens:
            self.context_cuts.append(f"a prompt of {prompt_tokens} tokens leaves {room} of {max_new_tokens} new "
                                     f"tokens under {flag} {limit}")
        return min(max_new_tokens, room)

    def prompt_ids(self, prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A prompt's tokens; pass its group's `tools` (the dataset record's, `--tool-key`) so the model sees them."""
        data = self.config.data
        return encode_prompt(self.tokenizer, prompt, chat_template=data.apply_chat_template,
                             chat_template_kwargs=data.apply_chat_template_kwargs, tools=tools,
                             describe_ignored_tools=self.config.agent.agent_describe_tools)

    def decode_response(self, token_ids: Sequence[int]) -> str:
        """The response text; --rollout-skip-special-tokens decides whether special tokens appear in it."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.config.rollout.rollout_skip_special_tokens)

    def request_id(self, group: PromptGroup) -> str:
        return f"{self.worker_id}/{group.group_id}/{next(_request_ids)}"


def make_sample(group: PromptGroup, index: int, prompt_ids: list[int], response_ids: list[int],
                log_probs: list[float], versions: list[int], *, response: str, status: str,
                loss_mask: list[int] | None = None, metadata: dict[str, Any] | None = None,
                routed_experts: RoutedExperts | None = None, messages: list[dict[str, Any]] | None = None) -> Sample:
    routes = None if routed_experts is None else routed_experts.table().reshape(-1).astype(np.int16)
    _, layers, top_k = routed_experts.shape if routed_experts is not None else (0, 0, 0)
    return Sample(
        sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index, prompt=group.prompt,
        prompt_tokens=len(prompt_ids),
        tokens=np.asarray(list(prompt_ids) + list(response_ids), dtype=np.int32),
        response=response, response_length=len(response_ids), label=group.label, reward=None,
        loss_mask=np.asarray(loss_mask if loss_mask is not None else [1] * len(response_ids), dtype=np.int8),
        rollout_log_probs=np.asarray(log_probs, dtype=np.float32),
        token_versions=np.asarray(versions, dtype=np.int32),
        routed_experts=routes, moe_layers=layers, moe_top_k=top_k,
        status=status, metadata={**group.metadata, "data_index": group.data_index, **(metadata or {})},
        error=None, messages=messages,
    )


class NoRoomError(ValueError):
    """A prompt that fills the context cap by itself: its samples fail (and are counted), the worker goes on."""


def failed_sample(group: PromptGroup, index: int, prompt_ids: list[int], reason: str) -> Sample:
    """Sample `index` marked failed with `reason`, no response: the buffer leaves it out of its group (or drops the
    group, `--failed-sample-policy`) and counts it."""
    return msgspec.structs.replace(make_sample(group, index, prompt_ids, [], [], [], response="", status="failed"),
                                   error=reason)


def failed_samples(group: PromptGroup, prompt_ids: list[int], reason: str) -> list[Sample]:
    """Every sample of the group marked failed with `reason`."""
    return [failed_sample(group, index, prompt_ids, reason) for index in range(group.n_samples)]


def groups_calls(generate: object) -> bool:
    """Whether a generate function's engine calls for one group belong together on one engine (the router keys them by
    the group): every function but the default single turn, whose one call per group has nothing to share with another,
    so the router places it by load, not on the group's owner on its ring (hashing groups would leave some engines
    more rows than they hold while others idle)."""
    return generate is not default_generate


async def default_generate(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """One turn: the prompt in, `n_samples` completions out."""
    prompt_ids = context.prompt_ids(group.prompt, group.tools)
    try:
        params = context.sampling_params(group, prompt_tokens=len(prompt_ids))
    except NoRoomError as error:
        return failed_samples(group, prompt_ids, str(error))
    try:
        outputs: list[GenerateOutput] = await context.engine.generate(
            GenerateRequest(request_id=context.request_id(group), input_ids=prompt_ids, params=params))
    except ContextFull as error:  # no engine of the run could take it: failed and counted, not re-issued forever
        return failed_samples(group, prompt_ids, str(error))
    return [
        make_sample(group, index, prompt_ids, out.output_ids, out.log_probs, out.versions,
                    response=context.decode_response(out.output_ids),
                    status=STATUS_BY_FINISH[out.finish_reason], routed_experts=out.routed_experts)
        for index, out in enumerate(outputs)
    ]
