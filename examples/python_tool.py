"""A sandboxed Python interpreter as a tool of the built-in episode loop:
`--agent-tools-path examples.python_tool:TOOLS --agent-tool-schemas-path examples.python_tool:SCHEMAS`.

The model writes `<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>`; the code runs
in an isolated interpreter (no environment, a scratch directory, memory, CPU-time and file-size limits, a
deadline: `examples/slime_style/retool_generate.py`), and its output is the tool's result.
"""

from __future__ import annotations

from examples.slime_style.retool_generate import run_python


async def python(code: str) -> str:
    """The program's output (its last 500 characters), or "timeout"."""
    return await run_python(code)


TOOLS = {"python": python}
SCHEMAS = [{"type": "function", "function": {
    "name": "python", "description": "run a Python program and return what it prints",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
