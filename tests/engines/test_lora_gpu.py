"""LoRA on CUDA: the trainer steps the adapter in bf16 autocast, and a bf16 engine on the GPU merges its push."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.inference import TorchEngine
from engines.training import TorchTrainer, TorchTrainerConfig
from engines.training.lora import LoraSettings, merged_state_dict
from tests.support.training import half_response_samples, loss_fn

ADAPTER = LoraSettings(rank=8, alpha=16.0)


@pytest.mark.gpu
async def test_a_cuda_lora_step_reaches_a_bf16_cuda_engine_merged(tiny_model_path: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path, lr=1e-2, device="cuda", dtype="bfloat16",
                                              lora=ADAPTER, ref_model_path=tiny_model_path))
    result = trainer.train_step(half_response_samples(), loss_fn(half_response_samples()), temperature=1.0)
    assert not result.skipped
    reference = trainer.compute_log_probs(half_response_samples(), temperature=1.0, model="ref").log_probs
    assert torch.isfinite(reference).all()
    sent = list(trainer.named_tensors())
    assert sent and all(tensor.is_cuda for _, tensor in sent)

    engine = TorchEngine.from_pretrained(tiny_model_path, dtype=torch.bfloat16, device="cuda",
                                         lora_scaling=ADAPTER.scaling)
    try:
        await engine.update_weights(sent, 1)
        served = engine.model.state_dict()
        for name, expected in merged_state_dict(trainer._model).items():
            assert served[name].is_cuda and served[name].dtype == torch.bfloat16
            torch.testing.assert_close(served[name].float(), expected.float(), atol=2e-2, rtol=2e-2, msg=name)
    finally:
        await engine.close()
