"""slime's --no-save-optim on the Megatron backend: a checkpoint of the weights alone (no optimizer shards), which a
trainer loads as the saved weights and version under a fresh optimizer, and trains on from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.rendezvous import cpu_gloo_rank, rendezvous_file
from tests.support.training import seeded_batch, step_loss

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")


def _save_then_resume(rank: int, rendezvous: str, model_path: str, out_dir: str) -> None:
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    with cpu_gloo_rank(rank, rendezvous, 1):
        config = MegatronTrainerConfig(model_path=Path(model_path), micro_batch_tokens=60, lr=1e-2,
                                       save_optimizer=False)
        batch = seeded_batch()
        trainer = MegatronTrainer(config)
        trainer.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True)
        trainer.save_checkpoint(Path(out_dir) / "checkpoint", {"cursor": 5})
        saved = {name: tensor.detach().clone() for name, tensor in trainer.named_tensors()}
        trainer.close()
        resumed = MegatronTrainer(config)
        extra = resumed.load_checkpoint(Path(out_dir) / "checkpoint")
        same = all(torch.equal(tensor, saved[name]) for name, tensor in resumed.named_tensors())
        step = resumed.train_step(batch, step_loss(batch), temperature=1.0, with_entropy=True)
        resumed.close()
        Path(out_dir, "result.json").write_text(json.dumps({"extra": extra, "same": same, "version": step.version,
                                                            "grad_norm": step.grad_norm}))


@pytest.mark.integration
def test_a_megatron_checkpoint_without_the_optimizer_resumes_its_weights(tiny_model_path: Path,
                                                                         tmp_path: Path) -> None:
    mp.start_processes(_save_then_resume, args=(rendezvous_file(), str(tiny_model_path), str(tmp_path)), nprocs=1,
                       join=True, start_method="spawn")
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["optimizer_saved"] is False
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["extra"] == {"cursor": 5} and result["same"] and result["version"] == 2
    assert result["grad_norm"] > 0
