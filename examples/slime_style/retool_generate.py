"""A retool-like multi-turn generate in slime's style: the model writes Python in ``<code>...</code>``, a
sandboxed interpreter runs it with a timeout, and the output comes back as ``<output>...</output>`` with loss
mask 0. Run with ``--custom-generate-function-path examples.slime_style.retool_generate:generate``.

Written as a slime plugin; it imports ``Sample`` and ``GenerateState`` from ``actors.slime_compat``, where slime's
``slime.*`` import lines would load the same classes (`actors.slime_compat.imports`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import signal
import sys
import tempfile
from typing import Any

from actors.slime_compat import GenerateState, Sample
from examples.slime_style.turns import append_observation, model_turn, prompt_ids

MAX_TURNS = 3
TOOL_TIMEOUT_S = 2.0
CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)


def _limit_resources() -> None:
    """In the child before exec: 256 MiB of memory, 2 s of CPU, no core files, no new files of any size."""
    resource.setrlimit(resource.RLIMIT_AS, (256 * 2**20, 256 * 2**20))
    resource.setrlimit(resource.RLIMIT_CPU, (2, 2))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


async def run_python(code: str, timeout_s: float = TOOL_TIMEOUT_S) -> str:
    """Run ``code`` in an isolated interpreter (``-I``, empty environment, scratch directory, rlimits)."""
    with tempfile.TemporaryDirectory() as scratch:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", code, cwd=scratch, env={}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, preexec_fn=_limit_resources,
        )
        try:
            out, _ = await asyncio.wait_for(process.communicate(), timeout=timeout_s)
        except asyncio.TimeoutError:
            # The program may have ended while the deadline passed (a busy event loop sees both at once): asyncio
            # then refuses to signal it, and there is nothing left to kill.
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            return "timeout"
    text = out.decode(errors="replace")[-500:].strip()
    if process.returncode is not None and process.returncode < 0:  # a limit hit: say which, the model can act on it
        limit = {signal.SIGXCPU: "its CPU time limit", signal.SIGKILL: "its memory or CPU limit"}.get(
            signal.Signals(-process.returncode), signal.Signals(-process.returncode).name)
        text = f"{text}\nkilled: the program ran past {limit}".strip()
    return text


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    state = GenerateState(args)
    if not sample.tokens:
        sample.tokens = prompt_ids(state.tokenizer, sample.prompt)
    budget = sampling_params["max_new_tokens"]
    for _ in range(MAX_TURNS):
        text = await model_turn(args, sample, {**sampling_params, "stop": ["</code>"]},
                                budget - sample.response_length)
        if sample.status == Sample.Status.ABORTED or sample.response_length >= budget:
            break
        closing = "" if text.rstrip().endswith("</code>") else "</code>"  # the server may trim the stop string
        match = CODE.search(text + closing)
        if match is None:
            break  # the model answered without calling the tool
        result = await run_python(match.group(1))
        append_observation(args, sample, state.tokenizer, f"{closing}<output>{result}</output>")
        if sample.response_length >= budget:
            sample.status = Sample.Status.TRUNCATED
            break
    return sample
