"""A reward that reads more than the decoded text: a right answer counts only in a response the model finished.

Run with ``--custom-rm-path examples.truncation_aware_rm:reward``. A response cut off at
``--rollout-max-response-len`` (``finish_reason == "length"``) scores 0 even when its last ``\\boxed{}`` answer
is right, so the policy is not taught that rambling past the limit pays. ``inp.response_ids`` are the tokens the
engine produced, special tokens included whatever ``--rollout-skip-special-tokens`` did to ``inp.response``:
``inp.response_ids[-1] == tokenizer.eos_token_id`` tells an EOS from a stop string (both end with ``"stop"``).
"""

from __future__ import annotations

from actors.plugins import RewardInput
from policies.rewards.text import exact_match_reward


def reward(inp: RewardInput) -> float:
    if inp.finish_reason != "stop" or not inp.response_ids:  # truncated, aborted, or nothing generated
        return 0.0
    return exact_match_reward(inp)
