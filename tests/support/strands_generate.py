"""A generate plugin written against strands-sglang as slime's strands example is (our code, slime's import lines).

slime's examples/strands_sglang runs a Strands agent whose model is strands-sglang's `SGLangModel`: Strands drives
the agent loop (model turn, tool calls, tool results, next turn), each model turn is one call of SGLang's native
`/generate` with token ids in and out, and the model's `rollout` keeps the whole trajectory's tokens, log-probs and
loss mask (tool results masked out), so nothing is tokenised twice. The plugin copies that trajectory into slime's
`Sample`. `tests/tools/test_slime_scripts.py` puts this module in a slime checkout as
``examples/strands_sglang/generate_with_strands.py``, the module slime's strands script names;
`tests/actors/test_slime_compat.py` runs it against the stand-in SGLang server.
"""

from __future__ import annotations

from typing import Any

from slime.rollout.rm_hub.math_dapo_utils import compute_score
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.types import Sample
from strands import Agent, tool
from strands.types.exceptions import MaxTokensReachedException
from strands_sglang import (
    MaxToolCallsReachedError,
    MaxToolIterationsReachedError,
    SGLangModel,
    ToolLimiter,
    get_client_from_slime_args,
)
from strands_sglang.tool_parsers import HermesToolParser

SYSTEM_PROMPT = "Add numbers with the add tool, then give the result as \\boxed{N}."
CUT = (MaxTokensReachedException, MaxToolCallsReachedError, MaxToolIterationsReachedError)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    state = GenerateState(args)
    model = SGLangModel(tokenizer=state.tokenizer, client=get_client_from_slime_args(args, timeout=60.0),
                        tool_parser=HermesToolParser(), sampling_params=sampling_params)
    agent = Agent(model=model, tools=[add], hooks=[ToolLimiter(max_tool_iters=2)], callback_handler=None,
                  system_prompt=SYSTEM_PROMPT)
    prompt = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    try:
        await agent.invoke_async(prompt)
        sample.status = Sample.Status.COMPLETED
    except CUT:  # the length limit or the tool limit ended the conversation: the trajectory so far trains
        sample.status = Sample.Status.TRUNCATED
    trajectory = model.rollout
    start = trajectory.initial_prompt_length  # the system prompt and the user's turn
    sample.tokens = list(trajectory.token_ids)
    sample.response_length = len(sample.tokens) - start
    sample.loss_mask = list(trajectory.loss_mask[start:])
    sample.rollout_log_probs = list(trajectory.logprobs[start:])
    sample.response = state.tokenizer.decode(sample.tokens[start:])
    model.reset()
    agent.cleanup()
    return sample


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> float:
    return compute_score(sample.response, sample.label or "")["score"]
