"""The Megatron trainer takes several optimizer steps per rollout batch like the torch trainer: the version moves
once per batch, the learning-rate schedule once per optimizer step, and the weights after both steps match.

One gloo rank on the CPU (megatron through `engines.megatron.cpu_compat`), spawned fresh as in
`test_megatron_parity.py`; the reference is the torch trainer in this process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engines.training import TorchTrainer, TorchTrainerConfig, checkpoint
from engines.training.base import Trainer
from tests.support.rendezvous import rendezvous_file
from tests.support.training import seeded_batch, step_loss
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

# Warmup over two optimizer steps: step 1 runs at lr / 2, step 2 at lr, only if the schedule counts steps.
OPTIMIZER = {"lr": 1e-2, "eps": 1.0, "grad_clip": None, "warmup_steps": 2, "micro_batch_tokens": 60}


def _halves() -> list[list]:
    batch = seeded_batch()
    return [batch[:3], batch[3:]]


def _two_steps(trainer: Trainer) -> dict:
    """One rollout batch in two optimizer steps, each with its own denominators."""
    seen = []
    for index, half in enumerate(_halves()):
        result = trainer.train_step(half, step_loss(half), temperature=1.0, with_entropy=True,
                                    ends_batch=index == 1)
        seen.append({"version": result.version, "lr": result.metrics["lr"], "skipped": result.skipped})
    return {"steps": seen, "version": trainer.version}


def _worker(rank: int, rendezvous: str, model_path: Path, out_dir: Path) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # megatron's CPU path on gloo, even on a CUDA machine
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=1)
    try:
        trainer = MegatronTrainer(MegatronTrainerConfig(model_path=model_path, **OPTIMIZER))
        summary = _two_steps(trainer)
        trainer.save_checkpoint(out_dir / "checkpoint", {})
        save_file({name: t.contiguous().clone() for name, t in trainer.named_tensors()},
                  str(out_dir / "weights.safetensors"))
        (out_dir / "summary.json").write_text(json.dumps(summary))
        trainer.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_steps_per_batch_move_the_version_once_and_match_the_torch_trainer(tmp_path: Path) -> None:
    model_path = cached_tiny_model(tmp_path / "models", TinyModelSpec(family="qwen2"))
    mp.spawn(_worker, args=(rendezvous_file(), model_path, tmp_path), nprocs=1, join=True)
    megatron = json.loads((tmp_path / "summary.json").read_text())

    reference = TorchTrainer(TorchTrainerConfig(model_path=model_path, check_packing=False, **OPTIMIZER))
    torch_summary = _two_steps(reference)
    assert megatron == torch_summary
    assert [step["version"] for step in megatron["steps"]] == [0, 1] and megatron["version"] == 1
    assert [step["lr"] for step in megatron["steps"]] == pytest.approx([5e-3, 1e-2])
    state = checkpoint.read_state(tmp_path / "checkpoint")
    assert (state["version"], state["optimizer_steps"]) == (1, 2)
    exported = load_file(str(tmp_path / "weights.safetensors"))
    for name, tensor in reference.named_tensors():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
