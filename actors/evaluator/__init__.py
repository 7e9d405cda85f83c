"""The evaluator role: rounds of held-out prompts at chosen weight versions, generated between training work.

`Evaluator` (actor.py) owns the rounds (`EvalRounds`): it asks the learner to pin the engines on a due version
(`WeightPin`), hands the round's groups to the buffer (`GuestGroups`, leased ahead of training prompts and never
trained on), records their scored groups as the buffer passes them back, writes `metrics/eval.jsonl`, and releases
the pin. When a round is due (`eval_due`, `next_due`) is one rule, here.
"""

from actors.evaluator.ids import eval_group_id, eval_round_of
from actors.evaluator.rounds import EvalRound, EvalRounds, eval_due, next_due, pass_at_k

__all__ = ["EvalRound", "EvalRounds", "eval_due", "eval_group_id", "eval_round_of", "next_due", "pass_at_k"]
