"""PPO with a critic: the value model reads the policy's positions, learns the returns, warms up alone, resumes
exactly from a checkpoint, and the settings that cannot work are refused by name."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from actors.config import build_config
from actors.config.slime_flags import apply_slime_flags
from actors.learner.stages import to_step_batch
from actors.learner.step import TrainingStep
from actors.learner.trainer_factory import build_trainer
from bus.schema import Sample
from engines.training.critic import ValueCritic
from policies.step_loss import explained_variance
from tests.actors.test_distillation import prompt_groups
from tests.actors.test_learner_step import generate, with_rewards


def ppo_config(model: Path, **settings: object):
    return build_config({"hf_checkpoint": str(model), "n_samples_per_prompt": 4, "rollout_max_response_len": 8,
                         "advantage_estimator": "ppo", "lambd": 0.95, "lr": 1e-3, "critic_lr": 3e-3, **settings})


@pytest.fixture(scope="module")
def scored(tiny_model_path: Path) -> list[Sample]:
    """Samples whose reward depends on the prompt alone (odd groups 1, even 0): returns a critic can learn."""
    samples = generate(tiny_model_path, ppo_config(tiny_model_path), prompt_groups(6))
    return with_rewards(samples, [float(int(s.group_id[1:]) % 2) for s in samples])


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def critic_of(trainer) -> ValueCritic:
    return trainer._critic


@pytest.mark.unit
def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean() -> None:
    returns = torch.tensor([1.0, 0.0, 2.0, 5.0, 9.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the untrained token is left out
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((5,), 2.0), returns, mask) == pytest.approx(0.0)
    assert explained_variance(-returns, returns, mask) < 0


@pytest.mark.integration
def test_the_critic_reads_each_token_where_the_policy_reads_its_log_prob(tiny_model_path: Path,
                                                                        scored: list[Sample]) -> None:
    """Packed and prompt-shared rows must give each token the value of the prefix before it, as a plain forward of
    the critic over that one sample does."""
    trainer = build_trainer(ppo_config(tiny_model_path))
    critic = critic_of(trainer)
    with torch.no_grad():
        torch.nn.init.normal_(critic.model.get_output_embeddings().weight, std=0.5)  # values that differ per token
    samples = to_step_batch(scored, rewarded=False).samples
    packed = trainer.compute_values(samples)
    plain = []
    with torch.no_grad():
        for sample in samples:
            logits = critic.model(input_ids=sample.tokens[None], use_cache=False).logits[0, :, 0]
            plain.append(logits[sample.prompt_length - 1:-1])
    torch.testing.assert_close(packed, torch.cat(plain), atol=1e-5, rtol=0)


@pytest.mark.integration
def test_the_critic_learns_the_returns_and_its_explained_variance_rises(tiny_model_path: Path,
                                                                       scored: list[Sample]) -> None:
    trainer = build_trainer(ppo_config(tiny_model_path))
    step = TrainingStep(trainer, ppo_config(tiny_model_path))
    reports = [step.train(scored, [0] * len(scored)).metrics for _ in range(10)]
    explained = [m["critic/explained_variance"] for m in reports]
    assert explained[0] == pytest.approx(0.0)  # a zero-initialised head: values 0, GAE gives the returns
    assert max(explained[-3:]) > 0.8, explained
    assert reports[-1]["critic/value_loss"] < 0.2 * reports[0]["critic/value_loss"]


@pytest.mark.integration
def test_a_batch_whose_samples_all_scored_alike_reports_no_explained_variance(tiny_model_path: Path,
                                                                             scored: list[Sample]) -> None:
    """With lambda < 1 such a batch's returns still differ, by the critic's own bootstrap alone; the ratio over that
    near-zero spread is noise (runs logged -50 and -100 between values of 0.9), so it is reported as missing."""
    config = ppo_config(tiny_model_path)
    trainer = build_trainer(config)
    with torch.no_grad():
        torch.nn.init.normal_(critic_of(trainer).model.get_output_embeddings().weight, std=0.5)  # values that vary
    step = TrainingStep(trainer, config)
    alike = step.train(with_rewards(scored, [1.0] * len(scored)), [0] * len(scored)).metrics
    assert math.isnan(alike["critic/explained_variance"])
    mixed = step.train(scored, [0] * len(scored)).metrics
    assert math.isfinite(mixed["critic/explained_variance"])


@pytest.mark.integration
def test_critic_only_warm_up_trains_the_critic_and_leaves_the_policy(tiny_model_path: Path,
                                                                     scored: list[Sample]) -> None:
    config = ppo_config(tiny_model_path, num_critic_only_steps=2)
    trainer = build_trainer(config)
    step = TrainingStep(trainer, config)
    policy, critic = weights(trainer._model), weights(critic_of(trainer).model)
    warm = [step.train(scored, [0] * len(scored)) for _ in range(2)]
    assert all(r.result.skipped and r.result.version == 0 for r in warm)
    assert all(torch.equal(policy[name], tensor) for name, tensor in weights(trainer._model).items())
    assert not torch.equal(critic["lm_head.weight"], critic_of(trainer).model.get_output_embeddings().weight)
    after = step.train(scored, [0] * len(scored))
    assert not after.result.skipped and after.result.version == 1


@pytest.mark.integration
def test_a_resumed_run_trains_its_critic_exactly_as_the_run_that_never_stopped(tiny_model_path: Path,
                                                                                scored: list[Sample],
                                                                                tmp_path: Path) -> None:
    config = ppo_config(tiny_model_path, num_critic_only_steps=2)
    first = build_trainer(config)
    step = TrainingStep(first, config)
    step.train(scored, [0] * len(scored))
    first.save_checkpoint(tmp_path / "ckpt", {"trained_batch": 1})
    for _ in range(2):  # the second batch is still critic-only: the warm-up count must survive the resume
        step.train(scored, [0] * len(scored))
    resumed = build_trainer(config)
    resumed.load_checkpoint(tmp_path / "ckpt")
    again = TrainingStep(resumed, config)
    reports = [again.train(scored, [0] * len(scored)) for _ in range(2)]
    assert [r.result.skipped for r in reports] == [True, False]
    for name, tensor in weights(critic_of(first).model).items():
        torch.testing.assert_close(critic_of(resumed).model.state_dict()[name], tensor, atol=0, rtol=0)
    for name, tensor in weights(first._model).items():
        torch.testing.assert_close(resumed._model.state_dict()[name], tensor, atol=0, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize(("settings", "message"), [
    ({"advantage_estimator": "ppo", "train_backend": "megatron"}, "has no value model"),
    ({"num_critic_only_steps": 3}, r"only with an estimator that reads values \(--advantage-estimator ppo"),
    ({"critic_lr": 1e-5}, r"only with an estimator that reads values \(--advantage-estimator ppo"),
    ({"advantage_estimator": "ppo", "custom_advantage_function_path": "m:f"}, "which a custom function"),
])
def test_critic_settings_that_cannot_work_are_refused_by_name(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config({"hf_checkpoint": "/m", **settings})


@pytest.mark.unit
def test_slimes_role_overrides_set_the_critics_and_the_actors_learning_rates(tmp_path: Path) -> None:
    roles = tmp_path / "megatron_ppo.yaml"
    roles.write_text("megatron:\n  - name: default\n    role: actor\n    overrides:\n      lr: 1e-6\n"
                     "  - name: default\n    role: critic\n    overrides:\n      lr: 1e-5\n", encoding="utf-8")
    args = argparse.Namespace(slime_megatron_config_path=str(roles))
    apply_slime_flags(args)
    assert (args.lr, args.critic_lr) == (1e-6, 1e-5)
    roles.write_text("megatron:\n  - role: critic\n    overrides:\n      tensor_model_parallel_size: 2\n",
                     encoding="utf-8")
    with pytest.raises(ValueError, match=r"critic overrides \['tensor_model_parallel_size'\] are not available"):
        apply_slime_flags(argparse.Namespace(slime_megatron_config_path=str(roles)))


@pytest.mark.integration
def test_reset_optimizer_states_resets_the_critics_adam_with_the_policys(tiny_model_path: Path,
                                                                          scored: list[Sample]) -> None:
    """slime resets every role's optimizer at each rollout: after two batches both Adams have taken one step."""
    config = ppo_config(tiny_model_path, reset_optimizer_states=True)
    trainer = build_trainer(config)
    step = TrainingStep(trainer, config)
    for _ in range(2):
        assert not step.train(scored, [0] * len(scored)).result.skipped
    for adam in (trainer._optimizer, critic_of(trainer)._optimizer):
        assert {int(state["step"]) for state in adam.state.values()} == {1}
