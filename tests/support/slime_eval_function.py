"""slime-style eval functions (``--eval-function-path``), answering as slime's eval_rollout does: per dataset the
rewards, the truncated flags and the samples. ``generate_rollout`` generates nothing (its test needs no server): it
records what it was called with in ``CALLS`` and answers fixed results. ``over_the_server`` is what a real one does:
it generates ``args.eval_prompt_data`` through the server ``args`` names, and says which weights answered."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from actors.slime_compat import RolloutFnEvalOutput, Sample, post
from engines.sglang.protocol import parse_weight_version

CALLS: list[dict[str, Any]] = []


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> RolloutFnEvalOutput:
    CALLS.append({"rollout_id": rollout_id, "evaluation": evaluation,
                  "server": (args.sglang_router_ip, args.sglang_router_port)})
    math = [Sample(prompt=f"{n}+{n}=", response=str(2 * n), label=str(2 * n)) for n in range(4)]
    return RolloutFnEvalOutput(
        data={"math": {"rewards": [1.0, 0.0, 1.0, 1.0], "truncated": [False, True, False, False], "samples": math},
              "code": {"rewards": [0.5, 0.5]}},
        metrics={"eval/custom_score": rollout_id * 10})


def legacy(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> dict[str, Any]:
    """slime's older return: the data dict alone."""
    return {"math": {"rewards": [0.0, 1.0]}}


async def over_the_server(args: Any, rollout_id: int, data_source: Any,
                          evaluation: bool = False) -> RolloutFnEvalOutput:
    """Each dataset of ``args.eval_prompt_data`` generated over SGLang's ``/generate`` at ``args.sglang_router_ip``
    and ``sglang_router_port``. A response scores the share of its token budget it used: a tiny random model answers
    no sum right, and a score no reward function of ours gives shows that the round's rewards are the function's.
    Its metrics say what a run cannot see otherwise: the weight version the server answered with
    (``served_weight_version``; -1 when its answers disagree), the ``rollout_id`` it was called with, and its own
    mean reward per dataset."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    budget = args.eval_max_response_len or args.rollout_max_response_len
    params = {"temperature": args.eval_temperature, "max_new_tokens": budget}
    pairs = args.eval_prompt_data
    data: dict[str, dict[str, list[Any]]] = {}
    metrics: dict[str, float] = {"eval/rollout_id": rollout_id}
    served = set()
    for name, path in zip(pairs[::2], pairs[1::2], strict=True):
        records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        replies = await asyncio.gather(*(post(url, {"text": record[args.input_key], "sampling_params": params})
                                         for record in records))
        served |= {parse_weight_version(reply["meta_info"]["weight_version"]) for reply in replies}
        rewards = [reply["meta_info"]["completion_tokens"] / budget for reply in replies]
        data[name] = {"rewards": rewards,
                      "truncated": [reply["meta_info"]["finish_reason"]["type"] == "length" for reply in replies],
                      "samples": [Sample(prompt=record[args.input_key], response=reply["text"],
                                         label=str(record[args.label_key]))
                                  for record, reply in zip(records, replies, strict=True)]}
        metrics[f"eval/{name}/function_mean_reward"] = sum(rewards) / len(rewards)
    metrics["eval/served_weight_version"] = served.pop() if len(served) == 1 and None not in served else -1
    return RolloutFnEvalOutput(data=data, metrics=metrics)
