"""A slime-style eval function (``--eval-function-path``), as slime's eval_rollout shapes its answer: per dataset the
rewards, the truncated flags and the samples. It generates nothing (the test needs no server): it records what it
was called with in ``CALLS`` and answers fixed results."""

from __future__ import annotations

from typing import Any

from actors.slime_compat import RolloutFnEvalOutput, Sample

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
