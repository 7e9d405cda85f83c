"""A reward that asks the judge actor: `--custom-rm-path examples.judge.reward:judge_reward`.

Each sample's reward is the judge's probability that the response is right (`examples/judge/actor.py`). The call
crosses the bus to whichever judge of the run has the fewest of this reward worker's calls in flight, and gives up
after JUDGE_TIMEOUT_S seconds (default 30; keep it under `--reward-timeout`, 60 by default, so that the judge's
own error is the one reported). A judge that is down, slow or failing raises `ActorCallError`, which names it;
the reward worker marks the sample failed with that reason, counts it (`samples.reward_failed`), and ends the run
only when `--reward-failure-limit` samples in a row failed, none scored.
"""

from __future__ import annotations

import os

from actors.plugins import RewardInput, call_actor


def _seconds(name: str, default: str) -> float:
    text = os.environ.get(name, default)
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{name}={text!r}: expected a number of seconds > 0")
    return value


JUDGE_TIMEOUT_S = _seconds("JUDGE_TIMEOUT_S", "30")


async def judge_reward(inp: RewardInput) -> float:
    return await call_actor("judge", "score", timeout=JUDGE_TIMEOUT_S, prompt=inp.prompt, response=inp.response,
                            label=inp.label)
