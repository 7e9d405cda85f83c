"""slime's learner flags read from a slime command line into our settings, with slime's meaning: the engine's
log-probs as pi_old (`--use-rollout-logprobs`), the optimizer reset per rollout (`--reset-optimizer-states`),
parameters frozen by name (`--only-train-params-name-list`, `--freeze-params-name-list`) and the reference model
refreshed every N rollouts (`--ref-update-interval`); and each refused where it contradicts another flag given,
naming both. What each does in the learner: tests/actors/test_learner_step.py and the trainers' tests."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from actors.config import config_from_args, split_sglang_args
from actors.config.run import RunConfig
from launcher import build_parser
from policies.pi_old import pi_old_source


def configure(*argv: str) -> RunConfig:
    rest, passthrough = split_sglang_args(list(argv))
    args: argparse.Namespace = build_parser().parse_args(["--head", *rest])
    args.sglang_passthrough = passthrough
    return config_from_args(args)


@pytest.mark.unit
@pytest.mark.parametrize("entry", [[], ["--slime-entry", "train_async"]], ids=["ours", "slime-entry"])
def test_rollout_logprobs_make_pi_old_the_engines_with_no_correction(entry: list[str]) -> None:
    config = configure("--use-rollout-logprobs", "--advantage-estimator", "grpo", *entry)
    assert config.policy.use_rollout_logprobs and config.policy.off_policy_correction == "none"
    assert pi_old_source(config.policy, decoupled=config.learner.use_decoupled_ppo) == "rollout"
    # without the flag our default recomputes pi_old (tis), so the flag is what changed it
    default = configure("--advantage-estimator", "grpo")
    assert pi_old_source(default.policy, decoupled=False) != "rollout"


@pytest.mark.unit
@pytest.mark.parametrize(("other", "message"), [
    (["--use-tis"], "--use-rollout-logprobs and --use-tis contradict"),
    (["--custom-tis-function-path", "my_tis:weights"],
     "--use-rollout-logprobs and --custom-tis-function-path contradict"),
    (["--use-decoupled-ppo"], "use_rollout_logprobs .* and use_decoupled_ppo .* contradict"),
    (["--off-policy-correction", "mis"], "use_rollout_logprobs .* off_policy_correction='mis'"),
], ids=["use-tis", "custom-tis", "decoupled-ppo", "correction"])
def test_rollout_logprobs_beside_a_recomputed_pi_old_is_refused_naming_both(other: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configure("--use-rollout-logprobs", *other)


@pytest.mark.unit
def test_reset_optimizer_states_and_ref_update_interval_are_trainer_settings() -> None:
    config = configure("--reset-optimizer-states", "--use-kl-loss", "--kl-loss-coef", "0.01",
                       "--ref-update-interval", "5")
    assert config.trainer.reset_optimizer_states and config.trainer.ref_update_interval == 5
    assert not RunConfig().trainer.reset_optimizer_states and RunConfig().trainer.ref_update_interval is None


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    (["--ref-update-interval", "3"], "ref_update_interval 3: this run has no reference model to refresh"),
    (["--ref-update-interval", "3", "--use-kl-loss", "--kl-loss-coef", "0.01", "--lora-rank", "8"],
     "ref_update_interval 3 with lora_rank 8: a LoRA run's reference is the base model"),
    (["--ref-update-interval", "0", "--use-kl-loss", "--kl-loss-coef", "0.01"],
     "--ref-update-interval 0: must be >= 1"),
], ids=["no-reference", "lora", "zero"])
def test_ref_update_interval_without_a_reference_of_its_own_is_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configure(*argv)


@pytest.mark.unit
def test_name_lists_are_read_as_slime_writes_them() -> None:
    config = configure("--only-train-params-name-list", "experts", r"layers\.2[0-3]\.")
    assert config.trainer.only_train_params_name_list == ["experts", r"layers\.2[0-3]\."]
    assert configure("--freeze-params-name-list").trainer.freeze_params_name_list == []  # slime's nargs=*: none


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    (["--only-train-params-name-list", "mlp", "--freeze-params-name-list", "embed"],
     "--only-train-params-name-list and --freeze-params-name-list were both given"),
    (["--freeze-params-name-list", "embed", "layers.("], r"--freeze-params-name-list 'layers\.\(': not a regular"),
], ids=["both", "bad-regex"])
def test_name_lists_slime_would_refuse_or_cannot_read_are_refused_by_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configure(*argv)


@pytest.mark.integration
def test_a_slime_freeze_list_reaches_the_torch_trainer_the_run_builds(tiny_model_path: Path) -> None:
    from actors.learner.trainer_factory import build_trainer

    trainer = build_trainer(configure("--hf-checkpoint", str(tiny_model_path), "--train-backend", "torch",
                                      "--freeze-params-name-list", "embed_tokens", "lm_head"))
    frozen = {name for name, parameter in trainer._model.named_parameters() if not parameter.requires_grad}
    assert frozen == {"model.embed_tokens.weight", "lm_head.weight"}


@pytest.mark.unit
def test_no_save_optim_reaches_both_backends_trainer_settings() -> None:
    from actors.learner.trainer_factory import _shared_settings

    assert _shared_settings(configure("--hf-checkpoint", "m"))["save_optimizer"] is True
    config = configure("--no-save-optim", "--hf-checkpoint", "m")
    assert config.learner.no_save_optim and _shared_settings(config)["save_optimizer"] is False


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    ([], "disable_compute_advantages_and_returns with loss_type 'ppo': its advantages would all be zero"),
    (["--rollout-data-postprocess-path", "m:f", "--custom-advantage-function-path", "m:g"],
     "disable_compute_advantages_and_returns and custom_advantage_function_path contradict"),
], ids=["nothing-sets-them", "custom-advantages"])
def test_advantages_off_with_nothing_to_set_them_is_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configure("--disable-compute-advantages-and-returns", *argv)
    for fine in (["--loss-type", "sft_loss"], ["--rollout-data-postprocess-path", "m:f"],
                 ["--custom-loss-function-path", "examples.slime_style.custom_loss:reinforce_loss"]):
        config = configure("--disable-compute-advantages-and-returns", *fine)
        assert config.learner.disable_compute_advantages_and_returns


@pytest.mark.unit
def test_keep_old_actor_on_policy_is_the_learners_own_pi_old_and_refused_off_policy() -> None:
    """slime's old actor is the weights that generated the batch: on-policy (train.py) the learner's before the
    update, which is the pi_old it recomputes (not the engine's log-probs, as without the flag under train.py)."""
    config = configure("--slime-entry", "train", "--keep-old-actor")
    assert config.learner.use_decoupled_ppo and config.buffer.max_staleness == 0
    assert pi_old_source(config.policy, decoupled=config.learner.use_decoupled_ppo) != "rollout"
    plain = configure("--slime-entry", "train")
    assert pi_old_source(plain.policy, decoupled=plain.learner.use_decoupled_ppo) == "rollout"
    with pytest.raises(ValueError, match="--keep-old-actor with --max-staleness 1: slime's old actor is a copy of "
                                         "the weights that generated the batch"):
        configure("--slime-entry", "train_async", "--keep-old-actor")


@pytest.mark.unit
def test_ckpt_step_flags_pick_that_step_of_the_checkpoint_folder(tmp_path: Path) -> None:
    """slime loads iteration N of --ref-load / --opd-teacher-load: Megatron's iter_NNNNNNN (slime's saves) or the
    learner's step_NNNNNN; a step the folder lacks is an error listing the steps it has."""
    for name in ("iter_0000005", "iter_0000010", "step_000003"):
        (tmp_path / name).mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    config = configure("--ref-load", str(tmp_path), "--ref-ckpt-step", "5", "--use-kl-loss", "--use-opd",
                       "--opd-type", "megatron", "--opd-teacher-load", str(tmp_path), "--opd-teacher-ckpt-step", "3")
    assert config.model.ref_checkpoint == str(tmp_path / "iter_0000005")
    assert config.distillation.opd_teacher_load == str(tmp_path / "step_000003")
    with pytest.raises(ValueError, match=r"--ref-ckpt-step 7: .* holds no checkpoint of that step \(iter_0000007 or "
                                         r"step_000007\); its steps: iter_0000005, iter_0000010, step_000003"):
        configure("--ref-load", str(tmp_path), "--ref-ckpt-step", "7")
    with pytest.raises(ValueError, match="--opd-teacher-ckpt-step 3 picks a step of --opd-teacher-load's checkpoint "
                                         "folder, which was not given"):
        configure("--opd-teacher-ckpt-step", "3")
