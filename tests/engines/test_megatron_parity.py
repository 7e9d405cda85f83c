"""The Megatron trainer takes the torch trainer's step: same log-probs, loss, gradient norm and updated weights; and
its distillation teacher, split as the policy is, scores as the torch trainer does.

Each layout (TP=1, TP=2, PP=2, DP=2 with the distributed optimizer) runs once in spawned gloo ranks on CPU
(megatron through `engines.megatron.cpu_compat`), writing what rank 0 saw; the layouts of one world share one
spawn, one after another (`tests/support/world_runs.py`). The reference is the torch trainer on the same HF model in
this process. AdamW runs with eps=1 so its first update stays proportional to the gradient: equal weights after the
step then mean equal gradients (plus equal clipping and weight decay). The ranks hide any GPU (`cpu_gloo_rank`), so
this stays the CPU path on a CUDA machine too; `test_megatron_gpu.py` is the GPU counterpart.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.training import TorchTrainer, TorchTrainerConfig
from tests.support.training import seeded_batch, step_loss
from tests.support.world_runs import WorldRuns
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

TEMPERATURE = 0.9
OPTIMIZER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1.0, "weight_decay": 0.1, "grad_clip": 0.05}
MICRO_BATCH_TOKENS = 60


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    world: int = 1
    tied: bool = False
    distributed_optimizer: bool = True
    dtype: str = "float32"
    resume_at_tp: int | None = None  # save after step 1; a fresh process loads at this TP size, step 2
    samples: int | None = None  # the step trains on the first `samples` of `seeded_batch()`; None: all of it
    teacher: bool = False  # also holds a distillation teacher (`teacher_path`) and scores the batch with it


LAYOUTS = {
    "tp1-tied": Layout(tied=True),
    "tp2": Layout(tensor_parallel=2, world=2, teacher=True),
    "pp2-tied": Layout(pipeline_parallel=2, world=2, tied=True, teacher=True),
    "dp2-resume-at-tp2": Layout(world=2, resume_at_tp=2),
    "tp1-bf16": Layout(dtype="bfloat16"),
    "dp2-one-sample": Layout(world=2, samples=1),
}


policy_loss = step_loss(seeded_batch())  # the whole batch's loss, which the torch references train on


def _megatron_config(model_path: Path, layout: Layout, tensor_parallel: int | None = None,
                     teacher_path: Path | None = None):
    from engines.megatron import MegatronTrainerConfig

    return MegatronTrainerConfig(
        model_path=model_path,
        teacher_model_paths={} if teacher_path is None else {"teacher": teacher_path},
        tensor_model_parallel_size=tensor_parallel or layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
        use_distributed_optimizer=layout.distributed_optimizer,
        dtype=layout.dtype,
        **OPTIMIZER,
    )


def _run_layout(rank: int, out_dir: Path, model_path: Path, layout_fields: dict, teacher_path: Path | None) -> None:
    from engines.megatron import MegatronTrainer
    from engines.training.base import teacher_role

    layout = Layout(**layout_fields)
    trainer = MegatronTrainer(_megatron_config(model_path, layout, teacher_path=teacher_path))
    batch = seeded_batch()[: layout.samples]
    outputs = trainer.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
    if teacher_path is not None:  # collective, like every call; rank 0 keeps it
        teacher = trainer.compute_log_probs(batch, temperature=TEMPERATURE, model=teacher_role("teacher")).log_probs
        if rank == 0:
            save_file({"log_probs": teacher}, str(out_dir / "teacher.safetensors"))
    result = trainer.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
    summary = {"step1": {"version": result.version, "grad_norm": result.grad_norm, "metrics": result.metrics}}
    weights = {name: tensor.contiguous().clone() for name, tensor in trainer.named_tensors()}
    if layout.resume_at_tp is not None:
        trainer.save_checkpoint(out_dir / "checkpoint", {"cursor": 7})
        uninterrupted = trainer.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
        summary["uninterrupted"] = {"version": uninterrupted.version, "grad_norm": uninterrupted.grad_norm}
        expected = {name: tensor.contiguous().clone() for name, tensor in trainer.named_tensors()}
        if rank == 0:
            save_file(expected, str(out_dir / "uninterrupted.safetensors"))
    if rank == 0:
        save_file({"log_probs": outputs.log_probs, "entropy": outputs.entropy}, str(out_dir / "outputs.safetensors"))
        save_file(weights, str(out_dir / "weights.safetensors"))
        (out_dir / "summary.json").write_text(json.dumps(summary))
    trainer.close()


def _resume_layout(rank: int, out_dir: Path, model_path: Path, layout_fields: dict, _: Path | None) -> None:
    """A fresh process, as after a learner restart, loads the checkpoint at `resume_at_tp` and takes step 2."""
    from engines.megatron import MegatronTrainer

    layout = Layout(**layout_fields)
    trainer = MegatronTrainer(_megatron_config(model_path, layout, layout.resume_at_tp))
    extra_state = trainer.load_checkpoint(out_dir / "checkpoint")
    batch = seeded_batch()[: layout.samples]
    resumed = trainer.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
    actual = {name: tensor.contiguous().clone() for name, tensor in trainer.named_tensors()}
    if rank == 0:
        save_file(actual, str(out_dir / "resumed.safetensors"))
        resume = {"extra_state": extra_state, "version": resumed.version, "grad_norm": resumed.grad_norm}
        (out_dir / "resumed.json").write_text(json.dumps(resume))
    trainer.close()


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    cache = tmp_path_factory.mktemp("megatron-models")
    return {
        tied: cached_tiny_model(cache, TinyModelSpec(family="qwen2", tie_word_embeddings=tied))
        for tied in (False, True)
    }


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distillation teacher of the student's tokenizer and its own shape (wider, four layers: two per stage)."""
    return cached_tiny_model(tmp_path_factory.mktemp("megatron-teacher"), TinyModelSpec(
        family="qwen2", hidden_size=96, intermediate_size=224, num_hidden_layers=4, num_attention_heads=6, seed=11))


@pytest.fixture(scope="module")
def runs(model_paths: dict, teacher_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each layout's run, shared by the tests that look at it (`WorldRuns`: one spawn per world)."""
    return WorldRuns(
        tmp_path_factory, {name: layout.world for name, layout in LAYOUTS.items()}, _run_layout,
        lambda name: (model_paths[LAYOUTS[name].tied], asdict(LAYOUTS[name]),
                      teacher_path if LAYOUTS[name].teacher else None), _resume_layout,
        [name for name, layout in LAYOUTS.items() if layout.resume_at_tp is not None],
    )


@pytest.fixture(scope="module")
def reference(model_paths: dict[bool, Path]) -> dict[bool, dict]:
    """The torch trainer's log-probs, step and weights, per tied/untied model."""
    results = {}
    for tied, path in model_paths.items():
        config = TorchTrainerConfig(
            model_path=path, micro_batch_tokens=MICRO_BATCH_TOKENS, check_packing=False, **OPTIMIZER
        )
        trainer = TorchTrainer(config)
        batch = seeded_batch()
        outputs = trainer.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
        step = trainer.train_step(batch, policy_loss, temperature=TEMPERATURE, with_entropy=True)
        weights = {name: tensor.clone() for name, tensor in trainer.named_tensors()}
        results[tied] = {"outputs": outputs, "step": step, "weights": weights}
    return results


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp1-tied", "tp2", "pp2-tied"])
def test_log_probs_and_entropy_match_the_torch_trainer(layout: str, runs: dict, reference: dict) -> None:
    saved = load_file(str(runs[layout] / "outputs.safetensors"))
    expected = reference[LAYOUTS[layout].tied]["outputs"]
    torch.testing.assert_close(saved["log_probs"], expected.log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(saved["entropy"], expected.entropy, rtol=0, atol=2e-5)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp2", "pp2-tied"])
def test_a_held_teachers_log_probs_match_the_torch_trainers_teacher(layout: str, runs: dict,
                                                                    teacher_path: Path) -> None:
    """A teacher of another shape than the policy, split over TP or PP ranks as the policy is."""
    saved = load_file(str(runs[layout] / "teacher.safetensors"))["log_probs"]
    trainer = TorchTrainer(TorchTrainerConfig(model_path=teacher_path, micro_batch_tokens=MICRO_BATCH_TOKENS,
                                              check_packing=False))
    expected = trainer.compute_log_probs(seeded_batch(), temperature=TEMPERATURE).log_probs
    torch.testing.assert_close(saved, expected, rtol=0, atol=2e-5)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp1-tied", "tp2", "pp2-tied", "dp2-resume-at-tp2"])
def test_train_step_loss_and_gradient_norm_match_the_torch_trainer(layout: str, runs: dict, reference: dict) -> None:
    step = json.loads((runs[layout] / "summary.json").read_text())["step1"]
    expected = reference[LAYOUTS[layout].tied]["step"]
    assert step["version"] == expected.version == 1
    assert step["metrics"]["loss"] == pytest.approx(expected.metrics["loss"], rel=1e-5)
    assert step["metrics"]["token_term"] == pytest.approx(expected.metrics["token_term"], rel=1e-5)
    assert step["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-5)
    assert expected.grad_norm > OPTIMIZER["grad_clip"]  # so clipping took part in the comparison


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp1-tied", "tp2", "pp2-tied", "dp2-resume-at-tp2"])
def test_exported_weights_after_a_step_equal_the_torch_trainers(layout: str, runs: dict, reference: dict) -> None:
    exported = load_file(str(runs[layout] / "weights.safetensors"))
    expected = reference[LAYOUTS[layout].tied]["weights"]
    assert {name: tuple(t.shape) for name, t in exported.items()} == {
        name: tuple(t.shape) for name, t in expected.items()
    }
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_checkpoint_resumed_at_another_layout_takes_the_uninterrupted_step(runs: dict) -> None:
    """Saved at DP=2 with the distributed optimizer, loaded by a fresh process at TP=2: weights, Adam moments, the
    Adam step count and the version survive the resharding (the second step would differ if any did not)."""
    out_dir = runs["dp2-resume-at-tp2"]
    uninterrupted_step = json.loads((out_dir / "summary.json").read_text())["uninterrupted"]
    resume = json.loads((out_dir / "resumed.json").read_text())
    assert resume["extra_state"] == {"cursor": 7}
    assert resume["version"] == uninterrupted_step["version"] == 2
    assert resume["grad_norm"] == pytest.approx(uninterrupted_step["grad_norm"], rel=1e-5)
    uninterrupted = load_file(str(out_dir / "uninterrupted.safetensors"))
    resumed = load_file(str(out_dir / "resumed.safetensors"))
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_bf16_step_tracks_the_torch_trainers_bf16_step(runs: dict, model_paths: dict[bool, Path]) -> None:
    """bf16 compute on both sides (fp32 master weights): equal up to bf16 rounding, not bit for bit."""
    out_dir = runs["tp1-bf16"]
    config = TorchTrainerConfig(
        model_path=model_paths[False], micro_batch_tokens=MICRO_BATCH_TOKENS, check_packing=False,
        dtype="bfloat16", **OPTIMIZER,
    )
    trainer = TorchTrainer(config)
    batch = seeded_batch()
    expected_outputs = trainer.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
    expected_step = trainer.train_step(batch, policy_loss, temperature=TEMPERATURE, with_entropy=True)
    expected_weights = dict(trainer.named_tensors())

    saved = load_file(str(out_dir / "outputs.safetensors"))
    torch.testing.assert_close(saved["log_probs"], expected_outputs.log_probs, rtol=0, atol=1e-2)  # seen: 2.2e-3
    step = json.loads((out_dir / "summary.json").read_text())["step1"]
    assert step["metrics"]["loss"] == pytest.approx(expected_step.metrics["loss"], rel=1e-3)  # seen: 8e-5
    assert step["grad_norm"] == pytest.approx(expected_step.grad_norm, rel=2e-3)  # seen: 4e-4
    exported = load_file(str(out_dir / "weights.safetensors"))
    for name, tensor in expected_weights.items():
        assert exported[name].dtype == torch.bfloat16, name
        # one bf16 step at 1.0 is 2^-7; seen: 3.2e-4
        torch.testing.assert_close(exported[name].float(), tensor.float(), rtol=0, atol=2**-7, msg=name)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_step_with_fewer_samples_than_data_parallel_ranks_is_the_torch_trainers_step(
        runs: dict, model_paths: dict[bool, Path]) -> None:
    """A learner step can hold one sample (filters dropped the rest, a batch split into several optimizer steps):
    the rank without a share runs a filler forward and joins the gradient reduction, where it refused before."""
    step = json.loads((runs["dp2-one-sample"] / "summary.json").read_text())["step1"]
    trainer = TorchTrainer(TorchTrainerConfig(model_path=model_paths[False], micro_batch_tokens=MICRO_BATCH_TOKENS,
                                              check_packing=False, **OPTIMIZER))
    one = seeded_batch()[:1]
    expected = trainer.train_step(one, step_loss(one), temperature=TEMPERATURE, with_entropy=True)
    assert step["metrics"]["loss"] == pytest.approx(expected.metrics["loss"], rel=1e-5)
    assert step["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-5)
