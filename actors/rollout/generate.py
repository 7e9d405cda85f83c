"""Turning one prompt group into samples: the default single-turn generation and the plugin point.

A custom generate function (`--custom-generate-function-path pkg.mod:fn`) has the signature
`async def fn(context: RolloutContext, group: PromptGroup) -> list[Sample]` and may call the engine several
times (multi-turn, tool calls). It builds samples with `make_sample`, passing a loss mask that zeroes the
tokens the policy did not produce (tool outputs), and the versions/log-probs of the tokens it did.
A slime-style `async def generate(args, sample, sampling_params) -> Sample` is detected by its signature and
adapted (`actors.slime_compat`); it reaches the engine over HTTP, so it needs `--rollout-engine sglang`.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from actors.config import RunConfig
from actors.slime_compat.plugins import adapt_generate, is_slime_style
from bus.schema import PromptGroup, Sample
from engines.inference.base import GenerateOutput, GenerateRequest, InferenceEngine, SamplingParams
from policies.plugins import load_object

GenerateFunction = Callable[["RolloutContext", PromptGroup], Awaitable[list[Sample]]]
STATUS_BY_FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}
_request_ids = itertools.count()


@runtime_checkable
class Tokenizer(Protocol):
    """What the rollout path uses of a tokenizer: a Hugging Face tokenizer satisfies it, and so does any small
    stand-in (tools/pipeline_sim.py), so an engine factory never has to pull in transformers to be typed."""

    eos_token_id: int | None

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, Any]:
        """`{"input_ids": [...]}` for one text."""

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                            tokenize: bool) -> Any:
        """Token ids of a chat (a list, or a mapping with "input_ids")."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...


@dataclass
class RolloutContext:
    engine: InferenceEngine
    tokenizer: Tokenizer
    config: RunConfig
    worker_id: str

    def sampling_params(self, group: PromptGroup, *, n: int | None = None) -> SamplingParams:
        config = self.config
        eval_greedy = group.is_eval and config.eval.eval_temperature == 0
        return SamplingParams(
            temperature=config.eval.eval_temperature if group.is_eval else config.rollout.rollout_temperature,
            top_p=1.0 if eval_greedy else config.rollout.rollout_top_p,
            top_k=0 if eval_greedy else config.rollout.rollout_top_k,
            max_new_tokens=config.rollout.rollout_max_response_len,
            stop=tuple(config.rollout.rollout_stop),
            n=group.n_samples if n is None else n,
        )

    def prompt_ids(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        if self.config.data.apply_chat_template or isinstance(prompt, list):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def request_id(self, group: PromptGroup) -> str:
        return f"{self.worker_id}/{group.group_id}/{next(_request_ids)}"


def make_sample(group: PromptGroup, index: int, prompt_ids: list[int], response_ids: list[int],
                log_probs: list[float], versions: list[int], *, response: str, status: str,
                loss_mask: list[int] | None = None, metadata: dict[str, Any] | None = None) -> Sample:
    return Sample(
        sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index, prompt=group.prompt,
        prompt_tokens=len(prompt_ids),
        tokens=np.asarray(list(prompt_ids) + list(response_ids), dtype=np.int32),
        response=response, response_length=len(response_ids), label=group.label, reward=None,
        loss_mask=np.asarray(loss_mask if loss_mask is not None else [1] * len(response_ids), dtype=np.int8),
        rollout_log_probs=np.asarray(log_probs, dtype=np.float32),
        token_versions=np.asarray(versions, dtype=np.int32),
        status=status, metadata={**group.metadata, "data_index": group.data_index, **(metadata or {})},
        error=None,
    )


async def default_generate(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """One turn: the prompt in, `n_samples` completions out."""
    prompt_ids = context.prompt_ids(group.prompt)
    outputs: list[GenerateOutput] = await context.engine.generate(
        GenerateRequest(request_id=context.request_id(group), input_ids=prompt_ids,
                        params=context.sampling_params(group))
    )
    return [
        make_sample(group, index, prompt_ids, out.output_ids, out.log_probs, out.versions,
                    response=context.tokenizer.decode(out.output_ids, skip_special_tokens=True),
                    status=STATUS_BY_FINISH[out.finish_reason])
        for index, out in enumerate(outputs)
    ]


async def sft_generate(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """SFT through the same system: the "response" is the label, teacher-forced, ended by EOS.

    Samples carry the engine's version so staleness bookkeeping stays uniform; their log-probs are zeros
    because the SFT loss never reads them.
    """
    if group.label is None:
        raise ValueError(f"group {group.group_id}: SFT needs a label (the target response), found none")
    prompt_ids = context.prompt_ids(group.prompt)
    target = str(group.label)
    response_ids = list(context.tokenizer(target, add_special_tokens=False)["input_ids"])
    if context.tokenizer.eos_token_id is not None:
        response_ids.append(context.tokenizer.eos_token_id)
    version = context.engine.version
    return [
        make_sample(group, index, prompt_ids, response_ids, [0.0] * len(response_ids), [version] * len(response_ids),
                    response=target, status="completed")
        for index in range(group.n_samples)
    ]


def choose_generate_function(config: RunConfig) -> GenerateFunction:
    custom = load_generate_function(config.rollout.custom_generate_function_path)
    path = config.rollout.custom_generate_function_path
    if custom is not None and is_slime_style(custom, 3):  # slime's generate(args, sample, sampling_params)
        return adapt_generate(custom, config, path or "")
    if config.rollout.rollout_sample_hook_path:
        raise ValueError("--rollout-sample-hook-path applies to a slime-style --custom-generate-function-path "
                         "(args, sample, sampling_params); with ours, edit the samples in the generate function")
    if custom is not None:
        return custom
    return sft_generate if config.policy.loss_type == "sft" else default_generate


def load_generate_function(path: str | None) -> GenerateFunction | None:
    if path is None:
        return None
    function = load_object(path, what="custom generate function")
    if not callable(function):
        raise TypeError(f"custom generate function {path!r} is not callable")
    return function  # type: ignore[return-value]
