"""Three small slime-style hooks around a rollout: a sample hook, a dynamic-sampling filter, a reward post-process.

Each has slime's signature and loads unchanged with its slime flag:
``--rollout-sample-hook-path examples.slime_style.batch_hooks:skip_unanswered`` (with a slime-style generate),
``--dynamic-sampling-filter-path examples.slime_style.batch_hooks:distinct_responses``,
``--custom-reward-post-process-path examples.slime_style.batch_hooks:centred_with_length_cost``.
"""

from __future__ import annotations

import re
from typing import Any

from actors.slime_compat import DynamicFilterOutput, Sample

LENGTH_COST = 0.1  # reward lost by a response that uses the whole --rollout-max-response-len


def skip_unanswered(args: Any, sample: Sample, *, rollout_id: int | None = None, evaluation: bool = False) -> Sample:
    """A response with no number in it cannot be graded on its answer: keep it in the group (its reward still
    shapes the baseline) but train none of its tokens, which is what slime's ``remove_sample`` means."""
    answered = re.search(r"-?\d", sample.response) is not None
    sample.metadata["answered"] = answered
    if not answered and not evaluation:
        sample.remove_sample = True
    return sample


def distinct_responses(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """A group whose responses are all the same text teaches nothing group-relative: drop it and say why."""
    distinct = len({s.response.strip() for s in samples})
    return DynamicFilterOutput(keep=distinct > 1, reason=None if distinct > 1 else "identical_responses")


def centred_with_length_cost(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """Group-centred rewards minus a cost proportional to length, so that among equally good answers the shorter
    one is preferred (slime's own post-process would divide by the group's std too)."""
    raw = [float(s.get_reward_value(args)) for s in samples]
    size = args.n_samples_per_prompt
    rewards: list[float] = []
    for start in range(0, len(samples), size):
        group = raw[start:start + size]
        mean = sum(group) / len(group)
        for sample, reward in zip(samples[start:start + size], group, strict=True):
            cost = LENGTH_COST * sample.response_length / args.rollout_max_response_len
            rewards.append(reward - mean - cost)
    return raw, rewards
