"""A proposer and a solver co-trained in one run, each its own policy: an episode that calls both.

The proposer is asked for an addition question; the solver answers each question it wrote, several times. The
solver trains on its answers (its reward: the right number), the proposer on its questions, rewarded for questions
at the edge of the solver's ability: a question the solver always or never gets right teaches it nothing. Each
policy trains on its own turns only (docs/multi-policy.md, "Episodes across policies").

    python -m examples.policies.proposer_solver runs/data/proposer  # the proposer's prompts
    python -m tools.make_arithmetic_data runs/data/sums --style question
    python launcher.py --head --config examples/policies/proposer_solver.yaml --hf-checkpoint MODEL \\
        --run-dir runs/proposer-solver

The solver also trains on a dataset of its own (sums of a two-digit and a one-digit number, the main demo's task);
the proposer's prompts name a number to build on, so its questions differ.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from actors.rollout.generate import RolloutContext, default_generate, make_sample
from bus.schema import STATUS_BY_FINISH, PromptGroup, Sample
from engines.inference.base import GenerateRequest
from policies.rewards import RewardInput
from policies.rewards.numbers import final_number_reward

QUESTION = re.compile(r"\b(\d{1,3}) ?\+ ?(\d{1,3})\b")
SOLVER_PROMPT = "What is {a} + {b}? Answer with just the number."


def question_of(response: str) -> tuple[int, int] | None:
    """The two numbers of the first sum "A + B" in a proposer's answer (of numbers below 1000); None when it wrote
    none."""
    found = QUESTION.search(response)
    return None if found is None else (int(found.group(1)), int(found.group(2)))


async def solve(context: RolloutContext, group: PromptGroup, key: str, a: int, b: int) -> tuple[list[Sample], float]:
    """The solver's answers to A + B, as a group of the solver's own in `group`'s episode, and the share right."""
    turns = context.group_for("solver", group, key, SOLVER_PROMPT.format(a=a, b=b), label=str(a + b))
    prompt_ids = context.prompt_ids(turns.prompt)
    params = context.sampling_params(turns, prompt_tokens=len(prompt_ids))
    outputs = await context.engine_of("solver").generate(GenerateRequest(context.request_id(turns), prompt_ids,
                                                                         params))
    answers = [make_sample(turns, index, prompt_ids, out.output_ids, out.log_probs, out.versions,
                           response=context.decode_response(out.output_ids),
                           status=STATUS_BY_FINISH[out.finish_reason])
               for index, out in enumerate(outputs)]
    right = [final_number_reward(RewardInput(prompt="", response=answer.response, label=turns.label,
                                             finish_reason=out.finish_reason))["reward"]
             for answer, out in zip(answers, outputs, strict=True)]
    return answers, sum(right) / len(right)


async def episode(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """The run's generate function: a proposer's group is the proposer's questions and, for each, the solver's group
    of answers; the solver's own prompts are answered as in any run."""
    if context.policy != "proposer":
        return await default_generate(context, group)
    questions = await default_generate(context, group)
    answers: list[Sample] = []
    for index, question in enumerate(questions):
        numbers = question_of(question.response)
        if numbers is None or question.status != "completed":
            continue
        solved, rate = await solve(context, group, str(index), *numbers)
        question.metadata["solve_rate"] = rate
        answers += solved
    return questions + answers


def edge_of_ability(inp: RewardInput) -> float:
    """The proposer's reward: 0 for no question; for a question, 0.2 plus up to 0.8 the closer the solver's share
    right is to one half (0.2 for a question it always, or never, gets right)."""
    rate = inp.metadata.get("solve_rate")
    return 0.0 if rate is None else 0.2 + 0.8 * 4 * rate * (1 - rate)


def proposer_prompts(first: range = range(10, 100)) -> list[dict[str, Any]]:
    return [{"input": f"Write one addition question about {n} and a one-digit number, in the form 'What is A + B?', "
                      "and nothing else.", "label": ""} for n in first]


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the proposer's prompts (OUT_DIR/train.jsonl).")
    parser.add_argument("out_dir", type=Path)
    path = parser.parse_args().out_dir / "train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in proposer_prompts()), encoding="utf-8")
    print(f"proposer: {path}")


if __name__ == "__main__":
    main()
