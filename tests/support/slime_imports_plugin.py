"""A generate plugin written as slime's examples are, against slime's own modules (our code, slime's import lines).

Shaped like slime's multi-agent example: the generate loads its agent through ``load_function``, each agent call
POSTs to the engine's ``/generate`` with ``post`` and appends the answer to a ``Sample``, and the generate scores its
agents' samples itself with ``batched_async_rm``. ``Calls`` counts the generate's calls in one ``SingletonMeta``
instance. `tests/tools/test_slime_scripts.py` puts it in a slime checkout as
``examples/multi_agent/rollout_with_multi_agents.py``, the module slime's multi-agent script names.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from slime.rollout.rm_hub import batched_async_rm
from slime.utils.http_utils import post
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.types import Sample

AGENTS = 2
PROMPT_TOKENS = [11, 12, 13]


class Calls(metaclass=SingletonMeta):
    def __init__(self) -> None:
        self.count = 0


async def answer(args: Any, sample: Sample) -> Sample:
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": PROMPT_TOKENS, "sampling_params": args.sampling_params,
                              "return_logprob": True})
    logprobs = output["meta_info"]["output_token_logprobs"]
    sample.tokens = list(PROMPT_TOKENS)
    sample.append_response_tokens(args, tokens=[item[1] for item in logprobs],
                                  log_probs=[item[0] for item in logprobs], meta_info=output["meta_info"])
    sample.response = output["text"]
    return sample


async def generate_with_multi_agents(args: Any, sample: Sample, sampling_params: dict[str, Any],
                                     evaluation: bool = False) -> list[Sample]:
    Calls().count += 1
    args.sampling_params = sampling_params
    agent = load_function(f"{__name__}.answer")
    samples = [await agent(args, deepcopy(sample)) for _ in range(AGENTS)]
    for agent_sample, reward in zip(samples, await batched_async_rm(args, samples), strict=True):
        agent_sample.reward = reward
    return samples
