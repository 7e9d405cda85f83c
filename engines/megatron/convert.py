"""HF folder <-> Megatron distributed checkpoint, in one process (what `tools/convert_checkpoint.py` runs).

Both directions go through `MegatronTrainer` at TP=PP=1 so the weights pass through exactly the code a run
uses (mbridge mapping, dist checkpointing). The megatron checkpoint holds the model only ("model" key) plus a
`trainer_state.json` marking it as a conversion; the trainer loads it through `initial_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path


def save_hf_as_megatron(hf_path: Path, out: Path) -> None:
    trainer = _trainer(hf_path)
    try:
        trainer.save_model_only(out, {"converted_from": str(hf_path)})
    finally:
        trainer.close()


def export_megatron_to_hf(hf_path: Path, megatron_path: Path, out: Path) -> None:
    if not megatron_path.is_dir():
        raise FileNotFoundError(f"--megatron {megatron_path}: no such directory")
    trainer = _trainer(hf_path, initial_checkpoint=megatron_path)
    try:
        trainer.export_hf(out)
    finally:
        trainer.close()


def _trainer(hf_path: Path, initial_checkpoint: Path | None = None):
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    if not (hf_path / "config.json").is_file():
        raise FileNotFoundError(f"--hf {hf_path}: no config.json (expected a Hugging Face model folder)")
    return MegatronTrainer(MegatronTrainerConfig(model_path=hf_path, initial_checkpoint=initial_checkpoint))
