"""A multi-turn, tool-using rollout: the model may call a calculator mid-answer.

Protocol in the text: the policy writes `<calc>EXPR</calc>`; generation stops at the closing tag, the
environment appends `<result>VALUE</result>`, and the policy continues, up to `MAX_TOOL_CALLS` calls. The
environment's tokens are part of the sequence the learner sees but carry loss mask 0, so the policy is only
trained on what it wrote itself; they carry the version of the token before them, so they never make a sample
look staler than the policy tokens around it.

Use it with `--custom-generate-function-path examples.calculator_env:calculator_generate`. It doubles as the
template for other environments: replace `run_tool` and the tags.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import re
from dataclasses import replace

from actors.plugins import STATUS_BY_FINISH, GenerateRequest, PromptGroup, RolloutContext, Sample, Trajectory

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
MAX_TOOL_CALLS = 4
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


class ToolError(ValueError):
    """The expression is not plain arithmetic, or too big to evaluate safely."""


def evaluate_arithmetic(expression: str) -> int | float:
    """Numbers and + - * / // % ** only; no names, calls or attributes, so model output can never run code."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from error

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        number = isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
        if number and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ToolError(f"exponent too large in {expression!r}")
            return _OPERATORS[type(node.op)](left, right)
        raise ToolError(f"unsupported element {type(node).__name__} in {expression!r}")

    try:
        return walk(tree)
    except ZeroDivisionError as error:
        raise ToolError(f"division by zero in {expression!r}") from error


def run_tool(call_text: str) -> str:
    """The environment's reply to the last call in `call_text`, as text to append."""
    calls = _CALL.findall(call_text)
    if not calls:
        return "<result>error: no call</result>"
    try:
        value = evaluate_arithmetic(calls[-1])
    except ToolError as error:
        return f"<result>error: {error}</result>"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"<result>{value}</result>"


async def calculator_generate(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    prompt_ids = context.prompt_ids(group.prompt, group.tools)
    return list(await asyncio.gather(*(
        _one_episode(context, group, index, prompt_ids) for index in range(group.n_samples)
    )))


async def _one_episode(context: RolloutContext, group: PromptGroup, index: int, prompt_ids: list[int]) -> Sample:
    base = context.sampling_params(group, n=1)
    budget = base.max_new_tokens
    trajectory = Trajectory(prompt_ids)  # the engine's tokens as generated, the tool's with loss mask 0
    finish = "length"
    calls = 0
    while budget > 0:
        params = replace(base, max_new_tokens=budget, stop=(*base.stop, CALL_CLOSE))
        output = (await context.engine.generate(GenerateRequest(
            request_id=context.request_id(group), input_ids=prompt_ids + trajectory.response_ids, params=params)))[0]
        trajectory.add_model(output.output_ids, output.log_probs, output.versions)
        budget -= len(output.output_ids)
        finish = output.finish_reason
        called = output.finish_reason == "stop" and output.matched_stop == CALL_CLOSE
        if not called or calls >= MAX_TOOL_CALLS or budget <= 0:
            break
        calls += 1
        reply_ids = list(context.tokenizer(run_tool(context.tokenizer.decode(output.output_ids)),
                                           add_special_tokens=False)["input_ids"])[:budget]
        trajectory.add_environment(reply_ids)
        budget -= len(reply_ids)
    return trajectory.to_sample(group, index, status=STATUS_BY_FINISH[finish], metadata={"tool_calls": calls},
                                response=context.tokenizer.decode(trajectory.response_ids, skip_special_tokens=True))
