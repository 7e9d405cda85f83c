"""A generate call as it crosses from one rollout worker to another's engine: `GenerateRequest` and
`GenerateOutput` to and from the wire messages (`bus.schema_engine`), field for field, so nothing about a sample
depends on which engine answered it."""

from __future__ import annotations

import numpy as np

from bus.schema import EngineGenerate, EngineOutput
from engines.inference.base import GenerateOutput, GenerateRequest, RoutedExperts, SamplingParams


def request_to_wire(request: GenerateRequest, *, min_version: int = 0) -> EngineGenerate:
    params = request.params
    return EngineGenerate(request_id=request.request_id, input_ids=list(request.input_ids),
                          max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                          n=params.n, seed=params.seed, ignore_eos=params.ignore_eos, min_version=min_version,
                          adapter=request.adapter, images=list(request.images))


def request_from_wire(call: EngineGenerate) -> GenerateRequest:
    """The request a call asks for; a ValueError names what is wrong with it (SamplingParams validates)."""
    params = SamplingParams(temperature=call.temperature, top_p=call.top_p, top_k=call.top_k,
                            max_new_tokens=call.max_new_tokens, stop=tuple(call.stop),
                            stop_token_ids=tuple(call.stop_token_ids), n=call.n, seed=call.seed,
                            ignore_eos=call.ignore_eos)
    return GenerateRequest(request_id=call.request_id, input_ids=list(call.input_ids), params=params,
                           adapter=call.adapter, images=tuple(call.images))


def output_to_wire(output: GenerateOutput) -> EngineOutput:
    routes = output.routed_experts
    return EngineOutput(
        output_ids=[int(token) for token in output.output_ids], log_probs=[float(lp) for lp in output.log_probs],
        versions=[int(version) for version in output.versions], finish_reason=output.finish_reason,
        sample_index=output.sample_index, prompt_len=output.prompt_len, matched_stop=output.matched_stop,
        routed_experts=None if routes is None else routes.table().reshape(-1).copy(),
        routed_experts_shape=[] if routes is None else list(routes.shape),
        cached_tokens=output.cached_tokens, stale_cached_tokens=output.stale_cached_tokens,
        reprefilled_tokens=output.reprefilled_tokens)


def output_from_wire(request_id: str, output: EngineOutput) -> GenerateOutput:
    routes = None
    if output.routed_experts is not None:
        if len(output.routed_experts_shape) != 3:
            raise ValueError(f"request {request_id!r}: routed_experts_shape {output.routed_experts_shape} is not "
                             "[tokens, layers, top_k]")
        routes = RoutedExperts.of(np.asarray(output.routed_experts).reshape(output.routed_experts_shape))
    return GenerateOutput(
        request_id=request_id, output_ids=list(output.output_ids), log_probs=list(output.log_probs),
        versions=list(output.versions), finish_reason=output.finish_reason, sample_index=output.sample_index,
        prompt_len=output.prompt_len, matched_stop=output.matched_stop, routed_experts=routes,
        cached_tokens=output.cached_tokens, stale_cached_tokens=output.stale_cached_tokens,
        reprefilled_tokens=output.reprefilled_tokens)
