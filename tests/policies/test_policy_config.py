import pydantic
import pytest

from policies.config import PolicyLossConfig


@pytest.mark.unit
def test_kl_as_reward_and_as_loss_together_is_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="choose one"):
        PolicyLossConfig(kl_coef=0.1, use_kl_loss=True, kl_loss_coef=0.01)


@pytest.mark.unit
def test_kl_loss_coefficient_without_kl_loss_is_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="no effect without use_kl_loss"):
        PolicyLossConfig(kl_loss_coef=0.01)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"eps_clip_c": 1.0}, "dual-clip bound must be > 1"),
        ({"tis_clip_low": 3.0}, "tis_clip_low=3.0 exceeds tis_clip=2.0"),
        ({"mis_lower_bound": 2.0}, "must be below mis_upper_bound"),
        ({"advantage_estimator": "reinforce_plus_plus"}, "set normalize_advantages=True"),
        ({"advantage_estimator": "grpo_v2"}, "unknown advantage estimator 'grpo_v2'"),
        ({"off_policy_correction": "nope.module:fn"}, "cannot import module 'nope.module'"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        ({"gamma": 1.5}, "gamma"),
        ({"eps_clip_hi": 0.3}, "eps_clip_hi"),
    ],
)
def test_invalid_settings_fail_at_construction_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        PolicyLossConfig(**fields)


@pytest.mark.unit
def test_derived_defaults_follow_slime() -> None:
    config = PolicyLossConfig(eps_clip=0.2, advantage_estimator="gspo")
    assert config.eps_clip_high == 0.2
    assert config.loss_type == "gspo"
    assert PolicyLossConfig(advantage_estimator="cispo").loss_type == "cispo"
    assert PolicyLossConfig(advantage_estimator="grpo").loss_type == "ppo"
    assert PolicyLossConfig(mis_upper_bound=4.0).mis_lower_bound == 0.25


@pytest.mark.unit
def test_config_is_frozen() -> None:
    with pytest.raises(pydantic.ValidationError):
        PolicyLossConfig().eps_clip = 0.3  # type: ignore[misc]
