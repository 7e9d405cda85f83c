"""Evaluation: rounds of held-out prompts at chosen weight versions, generated between training work.

What each role calls: the buffer queues and scores rounds (`EvalRounds`) and leases their groups ahead of training
prompts (`take_eval_groups`); the learner's weight cadence (`policies.weight_versions.WeightCadence`) pins the
engines on a version `round_due` names until its round has reported; a rollout worker reads from a group's id which
version it evaluates (`eval_version`). When a round is due (`eval_due`, `round_due`) is one rule, asked by the
buffer and by the learner.
"""

from actors.eval.ids import eval_group_id, eval_version, take_eval_groups
from actors.eval.rounds import EvalRound, EvalRounds, eval_due, pass_at_k, round_due

__all__ = ["EvalRound", "EvalRounds", "eval_due", "eval_group_id", "eval_version", "pass_at_k",
           "round_due", "take_eval_groups"]
