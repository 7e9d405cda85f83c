"""tools/convert_checkpoint.py: HF -> Megatron -> HF gives back the same weights, and a run can start from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

REPO = Path(__file__).resolve().parents[2]


def _convert(*args: str) -> None:
    finished = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_hf_to_megatron_and_back_round_trips_the_weights(tiny_model_path: Path, tmp_path: Path) -> None:
    _convert("hf-to-megatron", "--hf", str(tiny_model_path), "--out", str(tmp_path / "megatron"))
    assert (tmp_path / "megatron" / "trainer_state.json").is_file()
    _convert("megatron-to-hf", "--hf", str(tiny_model_path), "--megatron", str(tmp_path / "megatron"),
             "--out", str(tmp_path / "hf"))  # fmt: skip
    original = load_file(str(tiny_model_path / "model.safetensors"))
    round_trip = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(round_trip) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(round_trip[name], tensor.float(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # a complete folder transformers loads


@pytest.mark.integration
def test_missing_megatron_checkpoint_is_a_clear_error(tiny_model_path: Path, tmp_path: Path) -> None:
    finished = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "megatron-to-hf", "--hf", str(tiny_model_path),
         "--megatron", str(tmp_path / "absent"), "--out", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert finished.returncode != 0
    assert "absent: no such directory" in finished.stderr
