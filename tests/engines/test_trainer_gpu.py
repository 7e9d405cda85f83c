"""The torch trainer on CUDA scores and steps like it does on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.training import TorchTrainer, TorchTrainerConfig
from tests.support.training import half_response_samples, loss_fn


@pytest.mark.gpu
def test_cuda_step_matches_the_cpu_step(tiny_model_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    trainers = {
        device: TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-3, eps=1.0, device=device))
        for device in ("cpu", "cuda")
    }
    samples = half_response_samples()
    log_probs = {d: t.compute_log_probs(samples, temperature=0.7).log_probs for d, t in trainers.items()}
    torch.testing.assert_close(log_probs["cuda"], log_probs["cpu"], atol=1e-4, rtol=0)
    for trainer in trainers.values():
        assert not trainer.train_step(samples, loss_fn(samples), temperature=0.7).skipped
    cpu = dict(trainers["cpu"].named_tensors())
    for name, tensor in trainers["cuda"].named_tensors():
        assert tensor.is_cuda
        torch.testing.assert_close(tensor.cpu(), cpu[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
def test_bf16_autocast_step_trains_float32_master_weights(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, device="cuda", dtype="bfloat16"))
    result = trainer.train_step(half_response_samples(), loss_fn(half_response_samples()), temperature=1.0)
    assert not result.skipped and result.version == 1
    assert all(tensor.dtype == torch.float32 for _, tensor in trainer.named_tensors())


@pytest.mark.gpu
def test_a_step_syncs_with_the_host_as_often_for_eight_micro_batches_as_for_one(tiny_model_path: Path) -> None:
    """The micro-batch loop queues work and never waits for a number (losses, metrics stay on the device): a step's
    host syncs do not grow with its micro-batches."""
    import warnings

    samples = half_response_samples((40,) * 8)
    syncs = {}
    for micro_batch_tokens in (40 * 8, 40):
        trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, device="cuda", dtype="bfloat16",
                                                  micro_batch_tokens=micro_batch_tokens, check_packing=False))
        trainer.train_step(samples, loss_fn(samples), temperature=1.0)  # warm-up
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = trainer.train_step(samples, loss_fn(samples), temperature=1.0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert result.metrics["micro_batches"] == (1 if micro_batch_tokens > 40 else 8)
        syncs[micro_batch_tokens] = sum("synchroniz" in str(w.message) for w in caught)
        trainer.close()
    assert syncs[40] <= syncs[40 * 8] + 2, syncs
