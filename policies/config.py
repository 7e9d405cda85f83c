"""The one typed, validated-once algorithm config the learner and the advantage step share.

Field names are slime's flag names with dashes turned into underscores (``--eps-clip-high`` -> ``eps_clip_high``),
so a slime command line maps over one to one through :meth:`PolicyLossConfig.from_flags`. Every name-valued field
(estimator, loss, KL type, correction) is resolved against the registry at construction, so a typo or a broken
plugin path fails at start-up, not at step 1000.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.registry import ADVANTAGE_ESTIMATORS, CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES

__all__ = ["AggregationMode", "ISLevel", "PolicyLossConfig"]

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
ISLevel = Literal["token", "sequence", "geometric"]

# Loss implied by the advantage estimator when --loss-type is not given (slime picks the loss the same way).
_LOSS_FOR_ESTIMATOR = {"gspo": "gspo", "cispo": "cispo"}
# slime's --loss-type spellings.
_LOSS_ALIASES = {"policy_loss": None, "sft_loss": "sft"}
_ESTIMATORS_NEEDING_WHITENING = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


class PolicyLossConfig(BaseModel):
    """Everything that decides advantages and the training loss. Frozen: build once, pass everywhere."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- advantages and returns ---
    advantage_estimator: str = "grpo"
    rewards_normalization: bool = True  # --disable-rewards-normalization sets False
    grpo_std_normalization: bool = True  # --disable-grpo-std-normalization (Dr.GRPO) sets False
    reward_norm_eps: float = Field(1e-6, gt=0)
    normalize_advantages: bool = False
    whiten_unbiased: bool = Field(
        True, description="whitening divides the variance by n - 1 (Bessel), as slime; False: by n (population)"
    )
    untrained_token_rewards: Literal["skip", "keep"] = Field(
        "skip",
        description="ppo (GAE): 'skip' puts the KL penalty only on trained tokens and the reward on the last trained "
        "token; 'keep' (slime) puts the penalty on every response token and the reward on the last token",
    )
    gamma: float = Field(1.0, ge=0, le=1)
    lambd: float = Field(1.0, ge=0, le=1)

    # --- on-policy distillation (slime's --use-opd, --opd-kl-coef) ---
    use_opd: bool = Field(False, description="subtract opd_kl_coef x (log pi_student - log pi_teacher) from every "
                          "response token's advantage, after the estimator and before whitening, as slime; the "
                          "teachers are named in the run's distillation settings")
    opd_kl_coef: float = Field(1.0, ge=0, description="weight of the sampled reverse KL to the teacher in the "
                               "advantages (slime's default 1.0)")

    # --- loss ---
    loss_type: str | None = None  # None: implied by the estimator (gspo -> gspo, cispo -> cispo, else ppo)
    loss_agg_mode: AggregationMode = "seq-mean-token-mean"
    eps_clip: float = Field(0.2, ge=0)
    eps_clip_high: float | None = Field(None, ge=0)  # None: same as eps_clip
    eps_clip_c: float | None = None  # dual-clip bound for negative advantages, > 1
    value_clip: float = Field(0.2, gt=0)
    value_loss_coef: float = Field(1.0, ge=0)
    entropy_coef: float = 0.0
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
    kl_coef: float = Field(0.0, ge=0)  # KL as a reward penalty
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0)  # KL as a loss term
    kl_loss_type: str = "k1"
    use_unbiased_kl: bool = False
    low_var_kl_clamp_after_weight: bool = Field(
        False,
        description="with use_unbiased_kl, clamp low_var_kl to +-10 after the importance weight (slime) instead of "
        "before it",
    )

    # --- off-policy corrections ---
    off_policy_correction: str = "none"
    tis_level: ISLevel = "token"
    tis_clip: float = Field(2.0, gt=0)
    tis_clip_low: float = Field(0.0, ge=0)
    mis_level: ISLevel = "token"
    mis_upper_bound: float = Field(2.0, gt=0)
    mis_lower_bound: float | None = Field(None, ge=0)  # None: 1 / mis_upper_bound
    mis_veto_threshold: float | None = Field(None, gt=0)
    use_opsm: bool = False
    opsm_delta: float = Field(1e-4, ge=0)
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

    @model_validator(mode="after")
    def _check(self) -> PolicyLossConfig:
        # Fill the derived defaults (frozen models are mutated through object.__setattr__ during validation only).
        if self.eps_clip_high is None:
            object.__setattr__(self, "eps_clip_high", self.eps_clip)
        if self.loss_type in _LOSS_ALIASES:
            object.__setattr__(self, "loss_type", _LOSS_ALIASES[self.loss_type])
        if self.loss_type is None:
            object.__setattr__(self, "loss_type", _LOSS_FOR_ESTIMATOR.get(self.advantage_estimator, "ppo"))
        if self.mis_lower_bound is None:
            object.__setattr__(self, "mis_lower_bound", 1.0 / self.mis_upper_bound)

        if self.kl_coef != 0 and self.use_kl_loss and self.kl_loss_coef != 0:
            raise ValueError(
                f"kl_coef={self.kl_coef} (KL as reward penalty) and use_kl_loss with kl_loss_coef={self.kl_loss_coef} "
                "(KL as loss term) are both set; choose one"
            )
        if self.kl_loss_coef != 0 and not self.use_kl_loss:
            raise ValueError(f"kl_loss_coef={self.kl_loss_coef} has no effect without use_kl_loss=True")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c: dual-clip bound must be > 1, got {self.eps_clip_c}")
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(f"tis_clip_low={self.tis_clip_low} exceeds tis_clip={self.tis_clip}")
        assert self.mis_lower_bound is not None
        if self.mis_lower_bound >= self.mis_upper_bound:
            raise ValueError(
                f"mis_lower_bound={self.mis_lower_bound} must be below mis_upper_bound={self.mis_upper_bound}"
            )
        if self.advantage_estimator in _ESTIMATORS_NEEDING_WHITENING and not self.normalize_advantages:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} is defined with batch whitening; "
                "set normalize_advantages=True (--normalize-advantages)"
            )
        # Check every name now: unknown names and broken plugin paths fail here, at start-up (without importing
        # the built-ins' torch code: every actor validates this config, and a rollout worker never runs a loss).
        ADVANTAGE_ESTIMATORS.check(self.advantage_estimator)
        POLICY_LOSSES.check(self.loss_type)
        KL_ESTIMATORS.check(self.kl_loss_type)
        CORRECTIONS.check(self.off_policy_correction)
        return self

    @property
    def needs_ref(self) -> bool:
        """Whether a frozen reference model's log-probs take part: KL as a loss term or as a reward penalty.

        The one place that decides it: the trainer factory loads a reference model exactly when this holds, and
        the learner step computes reference log-probs exactly when this holds, so the two cannot disagree.
        """
        return self.use_kl_loss or self.kl_coef > 0

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> PolicyLossConfig:
        """Build from slime-style flags: keys may be ``--eps-clip-high`` or ``eps_clip_high``.

        Also understands slime's negative and legacy switches: ``disable_grpo_std_normalization``,
        ``disable_rewards_normalization``, ``calculate_per_token_loss`` (-> token-mean), ``use_tis``
        (-> off_policy_correction="tis"), ``custom_tis_function_path``, ``custom_loss_function_path``.
        Unknown keys are an error that lists what is accepted.
        """
        fields: dict[str, Any] = {}
        overrides: dict[str, Any] = {}
        switches = {
            "disable_grpo_std_normalization": ("grpo_std_normalization", False),
            "disable_rewards_normalization": ("rewards_normalization", False),
            "calculate_per_token_loss": ("loss_agg_mode", "token-mean"),
            "use_tis": ("off_policy_correction", "tis"),
        }
        renames = {"custom_tis_function_path": "off_policy_correction", "custom_loss_function_path": "loss_type"}
        for raw_key, value in flags.items():
            key = raw_key.lstrip("-").replace("-", "_")
            if key in switches:
                if value:
                    field, switched = switches[key]
                    fields.setdefault(field, switched)
            elif key in renames:
                if value is not None:
                    overrides[renames[key]] = value
            elif key in cls.model_fields:
                fields[key] = value
            else:
                accepted = sorted([*cls.model_fields, *switches, *renames])
                raise ValueError(f"unknown policy flag {raw_key!r}; accepted: {', '.join(accepted)}")
        fields.update(overrides)  # a custom function path wins over the switch that enables the feature
        if fields.get("loss_type") == "custom_loss":
            raise ValueError("loss_type='custom_loss' needs custom_loss_function_path (a dotted path to the loss)")
        return cls(**fields)
