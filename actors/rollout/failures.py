"""What a rollout worker makes of generation that fails for good: the run's failure breaker
(`actors.runtime.failures`) in generation's words, so a generate function that fails on every sample ends the run
instead of dropping prompt groups forever.

A generate plugin that raised on every sample (slime's retool plugin, before its fix) had the run drop 16,925
groups in 300 s and never end: each failed group is dropped at the buffer (or, when the function raised, given out
again when its lease expires) and the next prompt fails the same way. Counted here, a sample at a time:

- a sample sent on marked failed: a slime-style plugin or an agent episode that raised, a prompt over the context
  cap, an image the model cannot take (`generate.failed_sample`);
- every sample of a group whose generate function (ours) or engine raised (`raised`), unless the error is transient
  (`TRANSIENT`: a timeout, a lost connection, which the group's re-issue may well get past);
- every sample a slime rollout function held when its call raised.

Not counted: a sample an abort cut short (a weight update's pause, an SGLang server's restart), which is generated
again and never sent half done (`unless_aborted`). One sample generated starts the count again, so a
function that fails now and then never ends a run; `--generate-failure-limit` samples in a row (0 = never) do, with
"generate function X failed on N samples in a row, none generated (--generate-failure-limit N); last error: ...".
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from actors.config import RunConfig
from actors.runtime.failures import FailureBreaker
from bus.schema import PromptGroup, Sample

if TYPE_CHECKING:
    from actors.rollout.generate import GenerateFunction, RolloutContext

__all__ = ["ABORTED_RETRIES", "TRANSIENT", "GenerateFailures", "generation_subject", "unless_aborted"]

TRANSIENT = (TimeoutError, ConnectionError)  # no engine answered in time, one went away: the group's retry may not
ABORTED_RETRIES = 2  # a group whose generation an abort cut short is generated again this many times at most


class Generating(Protocol):
    """What `unless_aborted` reads of its rollout worker."""

    stopping: bool
    counters: Counter[str]
    log: Any


async def unless_aborted(generate: GenerateFunction, context: RolloutContext, group: PromptGroup,
                         samples: list[Sample], *, worker: Generating) -> list[Sample] | None:
    """`samples`, or the group generated again (by `generate`) while one of them was aborted: a sample an abort cut
    short (a pause for a weight update that a generate plugin calling the server itself did not resume, a server
    restart) was not generated, and trained it would be a partial or empty answer scored as wrong. After
    ABORTED_RETRIES tries, or while stopping, None: the group is not sent, and its lease brings it back."""
    for _ in range(ABORTED_RETRIES):
        if not any(sample.status == "aborted" for sample in samples) or worker.stopping:
            break
        worker.counters["groups.regenerated_after_abort"] += 1
        samples = await generate(context, group)
    if not any(sample.status == "aborted" for sample in samples):
        return samples
    if worker.stopping:  # the run's own stop aborted it: expected, and the lease brings it back on a resume
        worker.counters["groups.aborted_at_stop"] += 1
        return None
    worker.counters["groups.abandoned_after_abort"] += 1
    worker.log.warning("generation of a group kept being aborted; not sent, its lease will bring it back",
                       group=group.group_id, tries=ABORTED_RETRIES + 1)
    return None


def generation_subject(config: RunConfig) -> str:
    """What generates a worker's samples under `config`, as the breaker names it: the user's function where there is
    one (the same order `actors.rollout.choice` picks by), else the built-in generate and its engine."""
    rollout, agent = config.rollout, config.agent
    if rollout.rollout_function_path or agent.rollout_buffer_url:
        return (f"rollout function {rollout.rollout_function_path}" if rollout.rollout_function_path
                else f"rollout-buffer client of {agent.rollout_buffer_url}")
    for what, path in (("agent", agent.agent_function_path),
                       ("tool loop of --agent-tools-path", agent.agent_tools_path),
                       ("environment loop of --agent-environment-path", agent.agent_environment_path),
                       ("generate function", rollout.custom_generate_function_path)):
        if path:
            return f"{what} {path}"
    built_in = "SFT teacher forcing" if config.policy.loss_type == "sft" else "single-turn generate"
    return f"generation (built-in {built_in}, --rollout-engine {config.engine.rollout_engine})"


class GenerateFailures(FailureBreaker):
    """Counts a worker's generated samples, failed or not, for one policy, and logs the failures at a bounded rate."""

    def __init__(self, log: Any, config: RunConfig, **timing: Any) -> None:
        subject = generation_subject(config)
        super().__init__(log, subject, limit=config.rollout.generate_failure_limit, setting="generate_failure_limit",
                         what="generation", done="generated", fields={"generate_function": subject}, **timing)

    def record(self, samples: Iterable[Sample]) -> None:
        """Samples sent on: each failed one counts, each other starts the count again."""
        for sample in samples:
            if sample.status == "failed":
                self.failed(sample.sample_id, sample.error or "failed without a reason")
            elif sample.status != "aborted":
                self.succeeded()

    def raised(self, item: str, error: Exception, *, samples: int) -> None:
        """`item` (a group, a rollout function's call) lost `samples` samples to `error`, raised where it was being
        generated; logged with its traceback while failures are still logged one by one."""
        trace = "".join(traceback.format_exception(error))
        self.failed(item, f"raised {error!r}"[:1000], trace, samples=max(1, samples))
