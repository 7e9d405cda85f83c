"""tools/convert_checkpoint.py: HF -> Megatron -> HF gives back the same weights, and a run can start from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engines.training import TorchTrainer, TorchTrainerConfig
from tests.support.rendezvous import cpu_gloo_rank, rendezvous_file
from tests.support.training import seeded_batch
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")


FAMILIES = ("qwen2", "qwen3_moe")


def _run_tool(_: int, commands: list[list[str]]) -> None:
    """The tool's command lines, one after another in one fresh process, as `python -m tools.convert_checkpoint`
    runs each (importing megatron costs more than converting a tiny model, so it is imported once)."""
    from tools.convert_checkpoint import main

    for argv in commands:
        assert main(argv) == 0, argv


@pytest.fixture(scope="module")
def converted(tiny_model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Each family's tiny model converted by the tool to Megatron and back to HF: {"megatron": ..., "hf": ...}.
    The round trips and the expert-parallel load read the same conversions."""
    commands, folders = [], {}
    for family in FAMILIES:
        model_path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family=family))
        out = tmp_path_factory.mktemp(f"convert-{family}")
        folders[family] = {"megatron": out / "megatron", "hf": out / "hf"}
        commands += [["hf-to-megatron", "--hf", str(model_path), "--out", str(out / "megatron")],
                     ["megatron-to-hf", "--hf", str(model_path), "--megatron", str(out / "megatron"),
                      "--out", str(out / "hf")]]
    mp.spawn(_run_tool, args=(commands,), nprocs=1, join=True)
    return folders


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_and_back_round_trips_the_weights(family: str, tiny_model_cache: Path, converted: dict
                                                         ) -> None:
    """A mixture-of-experts checkpoint too: each expert leaves as megatron's grouped expert and comes back under
    its own checkpoint name."""
    model_path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family=family))
    assert (converted[family]["megatron"] / "trainer_state.json").is_file()
    original = load_file(str(model_path / "model.safetensors"))
    round_trip = load_file(str(converted[family]["hf"] / "model.safetensors"))
    assert sorted(round_trip) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(round_trip[name], tensor.float(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    AutoModelForCausalLM.from_pretrained(converted[family]["hf"])  # a complete folder transformers loads


def _expert_parallel_log_probs(rank: int, rendezvous: str, model_path: Path, converted: Path, out: Path) -> None:
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    with cpu_gloo_rank(rank, rendezvous, 2):
        trainer = MegatronTrainer(MegatronTrainerConfig(model_path=model_path, expert_model_parallel_size=2,
                                                        initial_checkpoint=converted))
        log_probs = trainer.compute_log_probs(seeded_batch(), temperature=1.0).log_probs
        if rank == 0:
            save_file({"log_probs": log_probs}, str(out))
        trainer.close()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_mixture_of_experts_checkpoint_converted_in_one_process_loads_with_its_experts_split_over_two_ranks(
        tiny_model_cache: Path, converted: dict, tmp_path: Path) -> None:
    """Converting is done once at EP 1; runs then start from it at any expert parallelism (megatron's sharded
    state names each expert by its global number)."""
    model_path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    # The run's HF folder holds other weights of the same shape: only a complete load gives the converted model's.
    other_weights = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe", seed=1))
    out, checkpoint = tmp_path / "log_probs.safetensors", converted["qwen3_moe"]["megatron"]
    mp.spawn(_expert_parallel_log_probs, args=(rendezvous_file(), other_weights, checkpoint, out), nprocs=2, join=True)
    expected = TorchTrainer(TorchTrainerConfig(model_path=model_path)).compute_log_probs(seeded_batch(),
                                                                                          temperature=1.0)
    torch.testing.assert_close(load_file(str(out))["log_probs"], expected.log_probs, rtol=0, atol=2e-5)


@pytest.mark.integration
def test_missing_megatron_checkpoint_is_a_clear_error(tiny_model_path: Path, tmp_path: Path) -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "tools.convert_checkpoint", "megatron-to-hf", "--hf", str(tiny_model_path),
         "--megatron", str(tmp_path / "absent"), "--out", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert finished.returncode != 0
    assert "absent: no such directory" in finished.stderr
