"""The Megatron trainer on CUDA: the first-contact checks of issue #13 (batches, NCCL world, collectives, optimizer,
bf16), each run in freshly spawned processes that write what they saw, compared with the torch trainer on the
CPU in this process (as `test_megatron_parity.py` does on gloo).

- "fp32": one GPU, the trainer forms its own NCCL world of one; log-probs, loss, gradient norm and the update
  match the torch trainer; a checkpoint written after step 1 and loaded by a fresh process takes the same step 2
  as the uninterrupted run (megatron's Adam on this machine: TE/apex FusedAdam or torch AdamW).
- "bf16": one GPU, bf16 model in Float16Module with fp32 master weights; `named_tensors()` yields bf16 CUDA
  tensors, and the step tracks the torch trainer's bf16 step up to bf16 rounding.
- "dp2": two GPUs (skipped with fewer), an NCCL world made by the caller, distributed optimizer: the whole-batch
  log-probs (summed over NCCL) and the step equal the one-rank ones.
- "plain": one GPU, a frozen reference model (what a KL term needs) and no distributed optimizer: every parameter
  of both models is on the GPU (the local spec's norms were left on the CPU unless that optimizer's buffer took
  them), and the reference's log-probs equal the policy's before the step. Its rows are padded (`bshd`); the
  other runs pack them (`thd`, the default: TE's varlen attention, or `SdpaAttention`'s packed path without TE).

Tolerances. With transformer-engine's layer spec, TE runs float32 GEMMs in TF32 (cuBLASLt
CUBLAS_COMPUTE_32F_FAST_TF32), so fp32 results agree to TF32 precision (~1e-3) only; with the local spec torch's
GEMMs run in full fp32 (TF32 is switched off in the workers), and agreement is tight.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import Tensor

from bus.address import free_port
from engines.training import TorchTrainer, TorchTrainerConfig
from tests.support.training import seeded_batch, step_loss
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

TEMPERATURE = 0.9
OPTIMIZER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1.0, "weight_decay": 0.1, "grad_clip": 0.05}
MICRO_BATCH_TOKENS = 60


@dataclass(frozen=True)
class Run:
    dtype: str = "float32"
    world: int = 1
    resume: bool = False
    reference: bool = False
    distributed_optimizer: bool = True
    qkv_format: str = "thd"


RUNS = {"fp32": Run(resume=True), "bf16": Run(dtype="bfloat16"), "dp2": Run(world=2),
        "plain": Run(reference=True, distributed_optimizer=False, qkv_format="bshd")}


policy_loss = step_loss(seeded_batch())  # every step of these tests trains on this one batch


def _config(model_path: Path, run: Run):
    from engines.megatron import MegatronTrainerConfig

    return MegatronTrainerConfig(
        model_path=model_path, micro_batch_tokens=MICRO_BATCH_TOKENS, dtype=run.dtype,
        ref_model_path=model_path if run.reference else None, use_distributed_optimizer=run.distributed_optimizer,
        qkv_format=run.qkv_format, **OPTIMIZER,
    )


def _start(rank: int, port: int, model_path: Path, run: Run):
    """Select this rank's GPU, form the caller's NCCL world when there are several ranks (with one, the trainer
    forms its own), build the trainer."""
    from engines.megatron import MegatronTrainer

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if run.world > 1:
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=run.world,
            device_id=torch.device("cuda", rank),
        )  # fmt: skip
    return MegatronTrainer(_config(model_path, run))


def _exported(trainer) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """The weights as float32 CPU copies, and each one's dtype and device as `named_tensors()` yielded it."""
    weights, seen = {}, {}
    for name, tensor in trainer.named_tensors():
        seen[name] = [str(tensor.dtype), str(tensor.device)]
        weights[name] = tensor.detach().float().cpu().contiguous().clone()
    return weights, seen


def _worker(rank: int, port: int, model_path: Path, out_dir: Path, run_fields: dict) -> None:
    run = Run(**run_fields)
    trainer = _start(rank, port, model_path, run)
    try:
        batch = seeded_batch()
        summary: dict = {
            "backend": dist.get_backend(),
            "world": dist.get_world_size(),
            "layer_spec": trainer._bridge.runtime.layer_spec,
            "parameter_devices": sorted({str(p.device) for p in trainer._stage.parameters()}),
            "reference_devices": sorted({str(p.device) for p in trainer._ref.parameters()}) if run.reference else [],
            "batch_devices": sorted(
                {str(t.device) for mb in trainer._micro_batches(batch, with_batch=True) for t in mb.tensors().values()}
            ),
            "adam": sorted({type(t).__module__ + "." + type(t).__name__ for t in _torch_optimizers(trainer)}),
        }
        initial, _ = _exported(trainer)
        outputs = trainer.compute_log_probs(batch, temperature=TEMPERATURE, with_entropy=True)
        if run.reference:
            reference = trainer.compute_log_probs(batch, temperature=TEMPERATURE, model="ref")
            summary["reference_log_prob_error"] = float((reference.log_probs - outputs.log_probs).abs().max())
        result = trainer.train_step(batch, policy_loss, temperature=TEMPERATURE, with_entropy=True)
        summary["step1"] = {"version": result.version, "grad_norm": result.grad_norm, "metrics": result.metrics}
        after, seen = _exported(trainer)
        summary["exported"] = seen
        if run.resume:
            trainer.save_checkpoint(out_dir / "checkpoint", {"cursor": 3})
            step2 = trainer.train_step(batch, policy_loss, temperature=TEMPERATURE, with_entropy=True)
            summary["step2"] = {"version": step2.version, "grad_norm": step2.grad_norm}
            uninterrupted, _ = _exported(trainer)
        if rank == 0:
            save_file({"log_probs": outputs.log_probs, "entropy": outputs.entropy}, str(out_dir / "outputs.st"))
            save_file(initial, str(out_dir / "initial.st"))
            save_file(after, str(out_dir / "after.st"))
            if run.resume:
                save_file(uninterrupted, str(out_dir / "uninterrupted.st"))
            (out_dir / "summary.json").write_text(json.dumps(summary))
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _resume_worker(rank: int, port: int, model_path: Path, out_dir: Path, run_fields: dict) -> None:
    run = Run(**run_fields)
    trainer = _start(rank, port, model_path, run)
    try:
        extra_state = trainer.load_checkpoint(out_dir / "checkpoint")
        step2 = trainer.train_step(seeded_batch(), policy_loss, temperature=TEMPERATURE, with_entropy=True)
        resumed, _ = _exported(trainer)
        if rank == 0:
            save_file(resumed, str(out_dir / "resumed.st"))
            report = {"extra_state": extra_state, "version": step2.version, "grad_norm": step2.grad_norm}
            (out_dir / "resumed.json").write_text(json.dumps(report))
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _torch_optimizers(trainer) -> list:
    from engines.megatron import optimizer

    return optimizer.torch_optimizers(trainer._optimizer)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_tiny_model(tmp_path_factory.mktemp("megatron-gpu-models"), TinyModelSpec(family="qwen2"))


@pytest.fixture(scope="module")
def runs(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each run is spawned once, lazily, and shared by the tests that look at it."""

    class Runs(dict):
        def __missing__(self, name: str) -> Path:
            run = RUNS[name]
            if torch.cuda.device_count() < run.world:
                pytest.skip(f"needs {run.world} GPUs, {torch.cuda.device_count()} visible")
            out_dir = tmp_path_factory.mktemp(name)
            mp.spawn(_worker, args=(free_port(), model_path, out_dir, asdict(run)), nprocs=run.world, join=True)
            if run.resume:
                args = (free_port(), model_path, out_dir, asdict(run))
                mp.spawn(_resume_worker, args=args, nprocs=run.world, join=True)
            self[name] = out_dir
            return out_dir

    return Runs()


@pytest.fixture(scope="module")
def reference(model_path: Path) -> dict[str, dict]:
    """The torch trainer's log-probs, step and weights on the CPU, per dtype."""
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = TorchTrainerConfig(
            model_path=model_path, micro_batch_tokens=MICRO_BATCH_TOKENS, check_packing=False, dtype=dtype, **OPTIMIZER
        )
        trainer = TorchTrainer(config)
        initial = {name: tensor.detach().float().clone() for name, tensor in trainer.named_tensors()}
        outputs = trainer.compute_log_probs(seeded_batch(), temperature=TEMPERATURE, with_entropy=True)
        step = trainer.train_step(seeded_batch(), policy_loss, temperature=TEMPERATURE, with_entropy=True)
        weights = {name: tensor.detach().float().clone() for name, tensor in trainer.named_tensors()}
        results[dtype] = {"outputs": outputs, "step": step, "initial": initial, "weights": weights}
    return results


def _summary(out_dir: Path) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


def _tolerances(summary: dict) -> dict[str, float]:
    """See the module docstring: TF32 under transformer-engine, full fp32 under the local spec."""
    if summary["layer_spec"] == "transformer_engine":
        return {"log_probs": 5e-3, "loss": 5e-3, "grad_norm": 1e-2, "update": 5e-2}
    return {"log_probs": 1e-4, "loss": 1e-4, "grad_norm": 1e-4, "update": 1e-3}


def _assert_same_update(before: dict, after: dict, expected_before: dict, expected_after: dict, tolerance: float):
    """Each tensor's change in the step, relative to the reference change: equal updates mean equal gradients
    (AdamW with eps=1 keeps the first update proportional to the gradient)."""
    assert sorted(after) == sorted(expected_after)
    for name, expected in expected_after.items():
        change, expected_change = after[name] - before[name], expected - expected_before[name]
        error = float((change - expected_change).norm() / expected_change.norm().clamp_min(1e-12))
        assert error < tolerance, f"{name}: update differs by {error:.2e} (relative)"


@pytest.mark.parametrize("name", ["fp32", "dp2"])
def test_gpu_trainer_runs_on_an_nccl_world_with_every_batch_tensor_on_its_gpu(name: str, runs: dict) -> None:
    summary = _summary(runs[name])
    assert summary["backend"] == "cpu:gloo,cuda:nccl"
    assert summary["world"] == RUNS[name].world
    assert summary["parameter_devices"] == ["cuda:0"]
    assert summary["batch_devices"] == ["cuda:0"]
    assert summary["adam"], "rank 0 must own parameters to optimise"


def test_a_reference_model_without_the_distributed_optimizer_lives_on_the_gpu(runs: dict) -> None:
    summary = _summary(runs["plain"])
    assert summary["parameter_devices"] == ["cuda:0"]
    assert summary["reference_devices"] == ["cuda:0"]
    assert summary["reference_log_prob_error"] < 1e-6  # the same weights


@pytest.mark.parametrize("name", ["fp32", "dp2", "plain"])
def test_fp32_gpu_step_matches_the_torch_trainer(name: str, runs: dict, reference: dict) -> None:
    out_dir, expected = runs[name], reference["float32"]
    summary = _summary(out_dir)
    tolerance = _tolerances(summary)
    saved = load_file(str(out_dir / "outputs.st"))
    torch.testing.assert_close(saved["log_probs"], expected["outputs"].log_probs, rtol=0, atol=tolerance["log_probs"])
    torch.testing.assert_close(saved["entropy"], expected["outputs"].entropy, rtol=0, atol=tolerance["log_probs"])
    step = summary["step1"]
    assert step["version"] == 1
    assert step["metrics"]["loss"] == pytest.approx(expected["step"].metrics["loss"], rel=tolerance["loss"])
    assert step["grad_norm"] == pytest.approx(expected["step"].grad_norm, rel=tolerance["grad_norm"])
    before, after = load_file(str(out_dir / "initial.st")), load_file(str(out_dir / "after.st"))
    _assert_same_update(before, after, expected["initial"], expected["weights"], tolerance["update"])
    assert all(dtype_device == ["torch.float32", "cuda:0"] for dtype_device in summary["exported"].values())


def test_gpu_checkpoint_resumes_with_the_uninterrupted_step(runs: dict) -> None:
    """Adam's moments and step count survive save and load in a fresh process, whichever Adam megatron built."""
    out_dir = runs["fp32"]
    summary, resumed_report = _summary(out_dir), json.loads((out_dir / "resumed.json").read_text())
    assert resumed_report["extra_state"] == {"cursor": 3}
    assert resumed_report["version"] == summary["step2"]["version"] == 2
    tolerance = _tolerances(summary)["grad_norm"]
    assert resumed_report["grad_norm"] == pytest.approx(summary["step2"]["grad_norm"], rel=tolerance)
    after = load_file(str(out_dir / "after.st"))
    uninterrupted, resumed = load_file(str(out_dir / "uninterrupted.st")), load_file(str(out_dir / "resumed.st"))
    _assert_same_update(after, resumed, after, uninterrupted, 1e-3)


def test_bf16_gpu_step_exports_bf16_cuda_weights_tracking_the_torch_bf16_step(runs: dict, reference: dict) -> None:
    out_dir, expected = runs["bf16"], reference["bfloat16"]
    summary = _summary(out_dir)
    assert summary["backend"] == "cpu:gloo,cuda:nccl" and summary["batch_devices"] == ["cuda:0"]
    assert summary["exported"] and all(seen == ["torch.bfloat16", "cuda:0"] for seen in summary["exported"].values())
    step = summary["step1"]
    assert step["version"] == 1
    assert step["metrics"]["loss"] == pytest.approx(expected["step"].metrics["loss"], rel=5e-3)  # CPU seen: 8e-5
    assert step["grad_norm"] == pytest.approx(expected["step"].grad_norm, rel=1e-2)  # CPU seen: 4e-4
    saved = load_file(str(out_dir / "outputs.st"))
    torch.testing.assert_close(saved["log_probs"], expected["outputs"].log_probs, rtol=0, atol=2e-2)  # CPU: 2.2e-3
    after, initial = load_file(str(out_dir / "after.st")), load_file(str(out_dir / "initial.st"))
    assert any(not torch.equal(after[name], initial[name]) for name in after), "the bf16 weights never moved"
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=2**-7, msg=name)  # one bf16 step at 1.0
