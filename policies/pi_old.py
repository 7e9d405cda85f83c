"""Where a learner step's proximal policy pi_old comes from: the one rule, read by the learner step and, torch-free,
by the run config's checks (light actors validate the config without importing torch)."""

from __future__ import annotations

from typing import Literal

from policies.config import PolicyLossConfig

__all__ = ["PiOldSource", "pi_old_source"]

# Corrections whose keep mask is all ones whatever pi_old is: the loss's denominators do not depend on pi_old.
# (mis rejects tokens by pi_old / mu, and a user correction may do the same, so neither is listed.)
_CORRECTIONS_WITHOUT_REJECTION = ("none", "tis", "icepop")

PiOldSource = Literal["rollout", "training_forward", "separate_forward"]


def pi_old_source(config: PolicyLossConfig, *, decoupled: bool, steps_per_batch: int = 1) -> PiOldSource:
    """Where the step's proximal policy pi_old comes from; the one rule, used by the learner step.

    - ``rollout``: no decoupling and no correction, or ``use_rollout_logprobs`` (slime's flag, which the config
      allows with neither): pi_old := mu, the engine's log-probs (SFT never reads it).
      mu does not change while a batch trains, so this holds for any number of optimizer steps per batch.
    - ``training_forward``: pi_old is the learner's policy before the batch's update. With one optimizer step per
      batch that is exactly the policy of the training forward, so ``sg(log pi_theta)`` of that forward IS pi_old
      and a separate no-grad forward (about a third of a step) is wasted. This holds only when nothing must know
      pi_old BEFORE the training forward: the loss's denominators (a correction that rejects tokens by
      ``pi_old / mu``, i.e. mis or a user correction, changes the token count that every micro-batch divides by)
      and the advantages (``kl_coef`` puts ``KL(pi_old || ref)`` into the rewards, ``use_opd`` puts
      ``log pi_old - log pi_teacher`` into them); and only with ONE step per
      batch (``steps_per_batch``): the second step's forward runs the already updated policy, while pi_old stays
      the policy before the batch's first step (PPO's several epochs over one rollout).
    - ``separate_forward``: otherwise; pi_old is computed by a no-grad forward once per batch, before its first
      optimizer step.
    """
    if steps_per_batch < 1:
        raise ValueError(f"steps_per_batch must be >= 1, got {steps_per_batch}")
    if config.loss_type == "sft" or config.use_rollout_logprobs or (
            not decoupled and config.off_policy_correction == "none"):
        return "rollout"
    if (config.kl_coef != 0 or config.use_opd or config.off_policy_correction not in _CORRECTIONS_WITHOUT_REJECTION
            or steps_per_batch > 1):
        return "separate_forward"
    return "training_forward"
