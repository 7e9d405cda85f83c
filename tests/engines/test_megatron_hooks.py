"""slime's per-step Megatron hooks on the Megatron trainer: `--custom-megatron-before-log-prob-hook-path` once
per log-prob pass, `--custom-megatron-before-train-step-hook-path` once per optimizer step, with slime's arguments;
a hook that raises stops the call with an error naming the flag and the path. The hook modules are written into
the test's directory and record their calls; the trainer is a real one-rank CPU Megatron trainer built from the
flags by the trainer factory, as a slime script's run would build it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.config import add_config_flags, config_from_args
from actors.learner.trainer_factory import build_trainer
from engines.megatron.model_flags import MegatronFlags, refuse_unsupported
from engines.training import checkpoint
from engines.training.base import teacher_role
from tests.support.training import seeded_batch, step_loss

LOG_PROB_FLAG = "--custom-megatron-before-log-prob-hook-path"
TRAIN_STEP_FLAG = "--custom-megatron-before-train-step-hook-path"

RECORDING_HOOKS = '''
import torch

CALLS = []


def init(args):
    args.initialised_by = "init hook"


def before_log_prob(args, model, store_prefix):
    args.hook_calls = getattr(args, "hook_calls", 0) + 1
    CALLS.append({"hook": "log_prob", "args": args, "lr": args.lr, "chunks": len(model),
                  "training": model[0].training, "store_prefix": store_prefix})


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    args.hook_calls = getattr(args, "hook_calls", 0) + 1
    grads = [p.main_grad for p in model[0].parameters() if getattr(p, "main_grad", None) is not None]
    CALLS.append({"hook": "train_step", "args": args, "rollout_id": rollout_id, "step_id": step_id,
                  "chunks": len(model), "training": model[0].training, "grads_zero": all(
                      bool((g == 0).all()) for g in grads) and bool(grads),
                  "weights": torch.cat([p.detach().float().flatten() for p in model[0].parameters()]).clone(),
                  "optimizer": type(optimizer).__module__, "scheduler": opt_param_scheduler})
'''

FAILING_HOOKS = '''
def explode(*args):
    raise ValueError("boom from the hook")
'''


def parse(argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.fixture
def hook_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test's directory on sys.path, and the hook modules imported from it forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("recording_hooks", "failing_hooks"):
        sys.modules.pop(name, None)


def _megatron_run(model_path: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(model_path), "--train-backend", "megatron", "--lr", "0.01",
            "--micro-batch-tokens", "30", *extra]


@pytest.mark.unit
def test_the_megatron_backend_accepts_the_hooks_and_the_torch_backend_refuses_them() -> None:
    flags = parse([LOG_PROB_FLAG, "m:f", TRAIN_STEP_FLAG, "m:g"]).megatron.set_flags()
    refuse_unsupported(flags, megatron_core=True)
    assert MegatronFlags(flags=flags).before_log_prob_hook_path == "m:f"
    assert MegatronFlags(flags=flags).before_train_step_hook_path == "m:g"
    for flag in (LOG_PROB_FLAG, TRAIN_STEP_FLAG):
        with pytest.raises(ValueError, match=f"{flag} m:f: a Megatron hook needs --train-backend megatron"):
            refuse_unsupported(parse([flag, "m:f"]).megatron.set_flags(), megatron_core=False)


@pytest.mark.unit
def test_a_hook_path_that_does_not_load_fails_before_the_trainer_is_built(tiny_model_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from policies.plugins import PluginError

    with pytest.raises(PluginError, match=f"{TRAIN_STEP_FLAG} 'no_such_hook_module:f': cannot import module"):
        build_trainer(parse(_megatron_run(tiny_model_path, TRAIN_STEP_FLAG, "no_such_hook_module:f")))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_hooks_run_once_per_pass_and_per_step_with_slimes_arguments(
    megatron_world: None, tiny_model_path: Path, hook_dir: Path
) -> None:
    import torch

    (hook_dir / "recording_hooks.py").write_text(RECORDING_HOOKS, encoding="utf-8")
    trainer = build_trainer(parse(_megatron_run(
        tiny_model_path, "--use-kl-loss", "--kl-loss-coef", "0.1", "--use-opd", "--opd-teacher-load",
        str(tiny_model_path), LOG_PROB_FLAG, "recording_hooks:before_log_prob",
        TRAIN_STEP_FLAG, "recording_hooks.before_train_step", "--custom-megatron-init-path", "recording_hooks:init")))
    import recording_hooks  # type: ignore[import-not-found]

    calls: list[dict[str, Any]] = recording_hooks.CALLS
    batch = seeded_batch()
    trainer.compute_log_probs(batch, temperature=1.0, model="ref")
    trainer.compute_log_probs(batch, temperature=1.0, model=teacher_role("teacher"))
    trainer.compute_log_probs(batch, temperature=1.0)
    assert [(c["hook"], c["store_prefix"], c["chunks"], c["training"]) for c in calls] == [
        ("log_prob", "ref_", 1, False), ("log_prob", "teacher_", 1, False),
        ("log_prob", "", 1, False)]  # once per pass, network in eval mode
    assert calls[0]["lr"] == 0.01  # the run's flat settings

    # Rollout 0 in two optimizer steps, then rollout 1 in one: several micro-batches each, one hook call each.
    results = [trainer.train_step(part, step_loss(part), temperature=1.0, with_entropy=True, ends_batch=ends)
               for part, ends in ((batch[:3], False), (batch[3:], True), (batch, True))]
    assert all(result.metrics["micro_batches"] > 1 and not result.skipped for result in results)
    steps = calls[3:]
    assert [(c["hook"], c["rollout_id"], c["step_id"]) for c in steps] == [
        ("train_step", 0, 0), ("train_step", 0, 1), ("train_step", 1, 0)]
    assert all(c["chunks"] == 1 and c["training"] and c["grads_zero"] for c in steps)
    assert all(c["optimizer"].startswith("megatron.core.optimizer") and c["scheduler"] is None for c in steps)
    # Called before the step's update: each call sees the weights the previous step left, which then change.
    assert not torch.equal(steps[0]["weights"], steps[1]["weights"])
    assert not torch.equal(steps[1]["weights"], steps[2]["weights"])
    # One namespace for the run, as slime's `args`: state a hook keeps on it survives between calls.
    assert all(c["args"] is calls[0]["args"] for c in calls) and calls[0]["args"].hook_calls == 6
    assert calls[0]["args"].initialised_by == "init hook"  # the init hook's args are that namespace too

    # The position survives a checkpoint: after a restart at rollout 2 the next step is rollout 2's first.
    trainer.save_checkpoint(hook_dir / "checkpoint", {})
    assert checkpoint.read_state(hook_dir / "checkpoint")["rollouts_trained"] == 2
    trainer.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True, ends_batch=True)
    trainer.load_checkpoint(hook_dir / "checkpoint")
    trainer.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True, ends_batch=False)
    assert [(c["rollout_id"], c["step_id"]) for c in calls[-2:]] == [(2, 0), (2, 0)]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_hook_that_raises_stops_the_call_with_its_path(
    megatron_world: None, tiny_model_path: Path, hook_dir: Path
) -> None:
    from engines.megatron.hooks import HookError

    (hook_dir / "failing_hooks.py").write_text(FAILING_HOOKS, encoding="utf-8")
    trainer = build_trainer(parse(_megatron_run(
        tiny_model_path, LOG_PROB_FLAG, "failing_hooks:explode", TRAIN_STEP_FLAG, "failing_hooks:explode")))
    batch = seeded_batch()
    with pytest.raises(HookError, match=f"{LOG_PROB_FLAG} 'failing_hooks:explode' raised ValueError: boom"):
        trainer.compute_log_probs(batch, temperature=1.0)
    before = {name: tensor.clone() for name, tensor in trainer.named_tensors()}
    with pytest.raises(HookError, match=f"{TRAIN_STEP_FLAG} 'failing_hooks:explode' raised ValueError: boom"):
        trainer.train_step(batch, step_loss(batch), temperature=1.0)
    assert trainer.version == 0
    for name, tensor in trainer.named_tensors():
        assert tensor.equal(before[name]), f"{name} changed although the step stopped"
