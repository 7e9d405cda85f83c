"""A multi-agent generate in slime's style: two solvers answer the task side by side, then a judge reads their
answers and gives the final one. Run with
``--custom-generate-function-path examples.slime_style.multi_agent:generate``.

Each agent's call to the engine is a sample of its own (its own prompt, its response tokens, the engine's
log-probs of them), and the call returns them all, as slime's multi-agent example does. Here that list is one
episode of segments (``actors.slime_compat.sample.to_wire_episode``): it counts once in its group, the reward
scores the judge's answer (the last sample) and every agent's sample carries it, so the agents are trained as one
team. Agents' prompts are built from the task and earlier agents' answers, never from their tokens, so each
sample's tokens are exactly what the engine saw and wrote.
"""

from __future__ import annotations

import asyncio
from copy import deepcopy
from typing import Any

from actors.slime_compat import Sample, load_tokenizer
from examples.slime_style.turns import model_turn, prompt_ids

SOLVERS = 2
SOLVER = "Solve the task and end with the answer.\nTask: {task}"
JUDGE = "Task: {task}\n{answers}\nWhich answer is right? Give the final answer."


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
                   ) -> list[Sample]:
    tokenizer = load_tokenizer(args.hf_checkpoint)
    context = (evaluation and args.eval_max_context_len) or args.rollout_max_context_len
    task = _task_text(sample.prompt)
    solvers = await asyncio.gather(*(_agent(args, sample, tokenizer, SOLVER.format(task=task), sampling_params,
                                            context) for _ in range(SOLVERS)))
    answers = "\n".join(f"Answer {number}: {solver.response.strip()}" for number, solver in enumerate(solvers, 1))
    judge = await _agent(args, sample, tokenizer, JUDGE.format(task=task, answers=answers), sampling_params,
                         context)
    return [*solvers, judge]


async def _agent(args: Any, task: Sample, tokenizer: Any, instruction: str, sampling_params: dict[str, Any],
                 context: int | None) -> Sample:
    """One agent's call: a copy of the task's sample (its label and metadata) with the agent's own prompt."""
    sample = deepcopy(task)
    sample.prompt = [{"role": "user", "content": instruction}]
    sample.tokens = prompt_ids(tokenizer, sample.prompt)
    budget = sampling_params["max_new_tokens"]
    if context:
        budget = min(budget, context - len(sample.tokens))
    if budget <= 0:  # the prompt alone fills the context: nothing to generate, nothing to train
        sample.status = Sample.Status.TRUNCATED
        return sample
    await model_turn(args, sample, sampling_params, budget)
    return sample


def _task_text(prompt: str | list[dict[str, Any]]) -> str:
    """The task as text: a chat prompt's last user message (--apply-chat-template leaves the messages)."""
    if isinstance(prompt, str):
        return prompt
    return next((str(m.get("content", "")) for m in reversed(prompt) if m.get("role") == "user"), "")
