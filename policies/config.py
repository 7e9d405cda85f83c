"""The one typed, validated-once algorithm config the learner and the advantage step share.

Field names are slime's flag names with dashes turned into underscores (``--eps-clip-high`` -> ``eps_clip_high``),
so a slime command line maps over one to one (its switches and legacy paths are translated with slime's other flags,
before this config is built). Every name-valued field (estimator, loss, KL type, correction) is resolved against
the registry at construction, so a typo or a broken plugin path fails at start-up, not at step 1000.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from policies.registry import (
    ADVANTAGE_ESTIMATORS,
    BATCH_WHITENED,
    CORRECTIONS,
    KL_ESTIMATORS,
    NEEDS_CRITIC,
    POLICY_LOSSES,
    BuiltinNames,
    implied_loss,
)

__all__ = ["AggregationMode", "ISLevel", "PolicyLossConfig"]

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
ISLevel = Literal["token", "sequence", "geometric"]

_REGISTRY_OF = {"advantage_estimator": ADVANTAGE_ESTIMATORS, "loss_type": POLICY_LOSSES,
                "kl_loss_type": KL_ESTIMATORS, "off_policy_correction": CORRECTIONS}


class PolicyLossConfig(BaseModel):
    """Everything that decides advantages and the training loss: the estimator, the loss, KL and the off-policy
    correction.

    Frozen: build once, pass everywhere."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- advantages and returns ---
    advantage_estimator: Annotated[str, BuiltinNames(ADVANTAGE_ESTIMATORS.listed_names)] = Field(
        "grpo", description="how each sample's advantage comes from its group's rewards (docs/policies.md, "
        "Advantages)")
    rewards_normalization: bool = Field(True, description="subtract the group's mean reward (the group baseline); "
                                        "--disable-rewards-normalization turns it off")
    grpo_std_normalization: bool = Field(True, description="divide the centred rewards by the group's standard "
                                         "deviation; off (--disable-grpo-std-normalization) is Dr.GRPO")
    reward_norm_eps: float = Field(1e-6, gt=0, description="eps in (reward - group mean) / (group std + eps)")
    normalize_advantages: bool = Field(False, description="whiten the advantages over the batch's trained tokens "
                                       "(across data-parallel ranks); the reinforce_plus_plus estimators need it")
    whiten_unbiased: bool = Field(
        True, description="whitening divides the variance by n - 1 (Bessel), as slime; False: by n (population)"
    )
    untrained_token_rewards: Literal["skip", "keep"] = Field(
        "skip",
        description="ppo (GAE): 'skip' puts the KL penalty only on trained tokens and the reward on the last trained "
        "token; 'keep' (slime) puts the penalty on every response token and the reward on the last token",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="discount of later token rewards in the returns (ppo, "
                         "reinforce_plus_plus)")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo): 1 gives Monte-Carlo returns, less leans on "
                         "the critic's values")
    step_discount: float = Field(1.0, ge=0, le=1, description="grpo_process: the weight, per step, of the later "
                                 "steps' normalised rewards in a token's advantage: 1 sums its own step's and every "
                                 "later one's (DeepSeekMath's process supervision), 0 credits a step's tokens with "
                                 "their own step's reward alone")

    # --- on-policy distillation (slime's --use-opd, --opd-kl-coef) ---
    use_opd: bool = Field(False, description="subtract opd_kl_coef x (log pi_student - log pi_teacher) from every "
                          "response token's advantage, after the estimator and before whitening, as slime; the "
                          "teachers are named in the run's distillation settings")
    opd_kl_coef: float = Field(1.0, ge=0, description="weight of the sampled reverse KL to the teacher in the "
                               "advantages (slime's default 1.0)")

    # --- loss ---
    loss_type: Annotated[str | None, BuiltinNames(POLICY_LOSSES.listed_names)] = Field(
        None, description="the policy loss (default: the estimator's: gspo for gspo, cispo for cispo, else ppo; "
        "slime's policy_loss and sft_loss are read as the default and sft)")
    loss_agg_mode: AggregationMode = Field(
        "seq-mean-token-mean", description="how token losses average: token-mean over every trained token of the "
        "step (DAPO), seq-mean-token-mean per sample then over samples (slime's default), seq-mean-token-sum "
        "(Dr.GRPO)")
    eps_clip: float = Field(0.2, ge=0, description="PPO clip: the ratio pi_theta / pi_old stops giving gradient "
                            "outside [1 - eps_clip, 1 + eps_clip_high]")
    eps_clip_high: float | None = Field(None, ge=0, description="upper PPO clip, for clip-higher (DAPO) "
                                        "(default: --eps-clip)")
    eps_clip_c: float | None = Field(None, description="dual-clip bound (> 1): a token with a negative advantage "
                                     "loses at most eps_clip_c x |advantage| (default: no dual clip)")
    value_clip: float = Field(0.2, gt=0, description="value loss: how far a value may move from its old value per "
                              "update before its error stops giving gradient (ppo's critic)")
    value_loss_coef: float = Field(1.0, ge=0, description="weight of the value loss when compute_policy_loss gets "
                                   "values (a policy sharing its trunk with a value head; the learner's ppo critic "
                                   "is a model of its own and does not use it)")
    entropy_coef: float = Field(0.0, description="entropy bonus: the loss subtracts entropy_coef x the mean entropy "
                                "of the trained tokens (0 = off)")
    log_ratio_clamp: float | None = Field(
        20.0,
        gt=0,
        description="clamp |log pi_theta - log pi_old| to this before exp (ppo/gspo/cispo, unbiased KL); "
        "None: no clamp (slime)",
    )
    count_empty_samples: bool = Field(
        False,
        description="a sample with no trained token still counts in the loss denominators: 1 token (token-mean) or "
        "1 sequence (seq-mean-*), as slime; False: it counts for nothing",
    )
    rejected_tokens_in_denominator: bool = Field(
        False,
        description="tokens an off-policy correction rejects (mis) leave the loss numerators but stay in the "
        "denominators, as slime; False: they leave both",
    )

    # --- KL ---
    kl_coef: float = Field(0.0, ge=0, description="KL to the reference model as a reward penalty (0 = off); not "
                           "together with --use-kl-loss")
    use_kl_loss: bool = Field(False, description="KL to the reference model as a loss term, weighted by "
                              "--kl-loss-coef")
    kl_loss_coef: float = Field(0.0, ge=0, description="weight of the KL loss term (needs --use-kl-loss)")
    kl_loss_type: Annotated[str, BuiltinNames(KL_ESTIMATORS.listed_names)] = Field(
        "k1", description="the KL estimator of both --kl-coef and --use-kl-loss (docs/policies.md, KL)")
    use_unbiased_kl: bool = Field(False, description="weight the KL loss by pi_theta / pi_old, which makes its "
                                  "gradient unbiased for tokens sampled from pi_old (DeepSeek-V3.2)")
    low_var_kl_clamp_after_weight: bool = Field(
        False,
        description="with use_unbiased_kl, clamp low_var_kl to +-10 after the importance weight (slime) instead of "
        "before it",
    )

    # --- off-policy corrections ---
    off_policy_correction: Annotated[str | None, BuiltinNames(CORRECTIONS.listed_names)] = Field(
        None, description="how the loss treats tokens generated by older weights than the ones it trains: tis "
        "weights each by pi_old / mu clamped to [--tis-clip-low, --tis-clip], mis drops those outside "
        "[--mis-lower-bound, --mis-upper-bound], icepop zeroes those outside the tis band, none leaves it to PPO's "
        "clip against the engine's log-probs (unless --use-decoupled-ppo); how to choose: docs/policies.md "
        "(default: tis, the fully-async default; none with an sft loss, which has no behaviour policy to correct "
        "for)")
    use_rollout_logprobs: bool = Field(False, description="pi_old is the engine's log-probs (mu), slime's cheapest "
                                       "mode: the learner does not recompute the policy's log-probs before the "
                                       "update; off_policy_correction is then none (a correction's weight pi_old / "
                                       "mu would be 1, so another one given is refused, as is --use-decoupled-ppo)")
    tis_level: ISLevel = Field("token", description="tis: the weight of each token, of each sequence (the product "
                               "of its tokens' ratios) or geometric (their geometric mean, per sequence)")
    tis_clip: float = Field(2.0, gt=0, description="tis: the weight pi_old / mu is clamped to at most this; "
                            "icepop: the kept band's upper edge")
    tis_clip_low: float = Field(0.0, ge=0, description="tis: the weight is clamped to at least this; icepop: the "
                                "kept band's lower edge")
    mis_level: ISLevel = Field("token", description="mis: the band is applied to each token's weight, or to each "
                               "sequence's (product or geometric mean), rejecting the whole sequence")
    mis_upper_bound: float = Field(2.0, gt=0, description="mis: a weight pi_old / mu above this rejects its token "
                                   "(or sequence) from the loss and its denominators")
    mis_lower_bound: float | None = Field(None, ge=0, description="mis: a weight below this rejects its token (or "
                                          "sequence) (default: 1 / --mis-upper-bound)")
    mis_veto_threshold: float | None = Field(None, gt=0, description="mis: reject a whole sequence when any of its "
                                             "tokens has a weight below this (default: no veto)")
    use_opsm: bool = Field(False, description="off-policy sequence masking (DeepSeek-V3.2): no loss for tokens with "
                           "a negative advantage in sequences that drifted more than --opsm-delta from the "
                           "policy that sampled them")
    opsm_delta: float = Field(1e-4, ge=0, description="OPSM: a sequence is off-policy when the mean of log mu - log "
                              "pi_theta over its trained tokens exceeds this")
    opsm_token_advantage: bool = Field(
        True,
        description="OPSM masks a token when ITS advantage is negative (slime, DeepSeek-V3.2); False: when its "
        "sequence's mean advantage is negative (the whole sequence)",
    )
    opsm_reference: Literal["rollout", "old"] = Field(
        "rollout",
        description="OPSM's sequence KL is taken from the engine's log-probs ('rollout') or from the learner's "
        "recomputed pi_old ('old', slime without --use-rollout-logprobs)",
    )

    @field_validator("advantage_estimator", "loss_type", "kl_loss_type", "off_policy_correction")
    @classmethod
    def _registered(cls, name: str | None, info: ValidationInfo) -> str | None:
        """Every name is checked now, each as its own field's error: an unknown name or a broken plugin path fails
        at start-up (without importing the built-ins' torch code: every actor validates this config, and a rollout
        worker never runs a loss)."""
        if name is not None:
            _REGISTRY_OF[info.field_name or ""].check(name)
        return name

    @field_validator("eps_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, bound: float | None) -> float | None:
        if bound is not None and bound <= 1.0:
            raise ValueError(f"dual-clip bound must be > 1, got {bound}")
        return bound

    @model_validator(mode="after")
    def _check(self) -> PolicyLossConfig:
        # Fill the derived defaults (frozen models are mutated through object.__setattr__ during validation only).
        if self.eps_clip_high is None:
            object.__setattr__(self, "eps_clip_high", self.eps_clip)
        if self.loss_type is None:  # the estimator's own loss, else PPO's (slime picks the loss the same way)
            object.__setattr__(self, "loss_type", implied_loss(self._estimator_traits) or "ppo")
        if self.use_rollout_logprobs and self.off_policy_correction not in (None, "none"):
            raise ValueError(f"use_rollout_logprobs takes pi_old from the engine's log-probs (mu), so "
                             f"off_policy_correction={self.off_policy_correction!r} would find pi_old / mu = 1 on "
                             "every token; give one of them")
        if self.off_policy_correction is None:
            plain = self.loss_type == "sft" or self.use_rollout_logprobs
            object.__setattr__(self, "off_policy_correction", "none" if plain else "tis")
        if self.mis_lower_bound is None:
            object.__setattr__(self, "mis_lower_bound", 1.0 / self.mis_upper_bound)

        if self.kl_coef != 0 and self.use_kl_loss and self.kl_loss_coef != 0:
            raise ValueError(
                f"kl_coef={self.kl_coef} (KL as reward penalty) and use_kl_loss with kl_loss_coef={self.kl_loss_coef} "
                "(KL as loss term) are both set; choose one"
            )
        if self.kl_loss_coef != 0 and not self.use_kl_loss:
            raise ValueError(f"kl_loss_coef={self.kl_loss_coef} has no effect without use_kl_loss=True")
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(f"tis_clip_low={self.tis_clip_low} exceeds tis_clip={self.tis_clip}")
        assert self.mis_lower_bound is not None
        if self.mis_lower_bound >= self.mis_upper_bound:
            raise ValueError(
                f"mis_lower_bound={self.mis_lower_bound} must be below mis_upper_bound={self.mis_upper_bound}"
            )
        if BATCH_WHITENED in self._estimator_traits and not self.normalize_advantages:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} is defined with batch whitening; "
                "set normalize_advantages=True (--normalize-advantages)"
            )
        return self

    @property
    def needs_critic(self) -> bool:
        """Whether the advantage estimator reads a critic's values (its NEEDS_CRITIC trait: PPO's, or a plugin's
        that declares it), so the learner trains a critic beside the policy. Read from the registry, not from a
        name, so a plugin estimator gets its critic too."""
        return NEEDS_CRITIC in self._estimator_traits

    @property
    def _estimator_traits(self) -> frozenset[str]:
        return ADVANTAGE_ESTIMATORS.traits_of(self.advantage_estimator)

    @property
    def needs_ref(self) -> bool:
        """Whether a frozen reference model's log-probs take part: KL as a loss term or as a reward penalty.

        The one place that decides it: the trainer factory loads a reference model exactly when this holds, and
        the learner step computes reference log-probs exactly when this holds, so the two cannot disagree.
        """
        return self.use_kl_loss or self.kl_coef > 0
