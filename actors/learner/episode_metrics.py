"""What a batch says about its episodes beyond one turn: tool use, turn lengths, and samples that span weights.

Read off what every sample already carries (its metadata counts from `Trajectory` and the tool loop, its loss mask
and per-token versions), so a custom generate function that builds its samples with `Trajectory` is measured the
same way as the built-in tool loop and the agent endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bus.episodes import by_episode, final_segment
from bus.schema import Sample


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`multiturn/*` for a batch with multi-turn samples (none otherwise), per episode, and `partial/*` always: the
    share of samples whose tokens came from more than one weight version (a weight update landed mid-sample).

    An agent that rewrote its context made its episode several samples (segments, `bus.episodes`): the counts an
    episode's metadata holds (tool calls, errors, per-turn rewards; the same on each segment) are read once, off
    its final segment; turns and tokens are summed over its segments; `multiturn/segments_per_episode` says how
    many there were (1.0: no agent rewrote its context)."""
    metrics: dict[str, float] = {}
    mixed = [s for s in samples if s.token_versions is not None and len(s.token_versions)
             and int(np.max(s.token_versions)) != int(np.min(s.token_versions))]
    metrics["partial/mixed_version_fraction"] = len(mixed) / len(samples) if samples else 0.0
    multiturn = [s for s in samples if isinstance(s.metadata.get("turns"), int)]
    if not multiturn:
        return metrics
    episodes = list(by_episode(multiturn).values())
    finals = [final_segment(segments) for segments in episodes]
    turns = sum(s.metadata["turns"] for s in multiturn)
    calls = sum(int(s.metadata.get("tool_calls", 0)) for s in finals)
    errors = sum(int(s.metadata.get("tool_errors", 0)) for s in finals)
    undeclared = sum(int(s.metadata.get("undeclared_tool_calls", 0)) for s in finals)
    model_tokens = sum(int(np.sum(s.loss_mask)) if s.loss_mask is not None else s.response_length for s in multiturn)
    response_tokens = sum(s.response_length for s in multiturn)
    metrics |= {
        "multiturn/turns_mean": turns / len(episodes),
        "multiturn/tool_calls_mean": calls / len(episodes),
        "multiturn/tool_error_fraction": errors / calls if calls else 0.0,
        # calls to a function the request's tools did not declare (actors/rollout/chat_session.py): the policy
        # inventing tools, which the agent endpoint returns as any other call
        "multiturn/undeclared_tool_calls_mean": undeclared / len(episodes),
        "multiturn/model_tokens_per_turn": model_tokens / turns if turns else 0.0,
        "multiturn/environment_token_fraction": 1 - model_tokens / response_tokens if response_tokens else 0.0,
        "multiturn/truncated_fraction": float(np.mean([s.status == "truncated" for s in finals])),
        "multiturn/segments_per_episode": len(multiturn) / len(episodes),
    }
    turn_rewards = [float(r) for s in finals for r in s.metadata.get("turn_rewards") or []]
    if turn_rewards:  # an environment that rewards turns (actors/rollout/environment.py)
        metrics["multiturn/turn_reward_mean"] = float(np.mean(turn_rewards))
        metrics["multiturn/rewarded_turns_per_episode"] = len(turn_rewards) / len(episodes)
    return metrics
