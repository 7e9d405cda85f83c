"""A mixture-of-experts model's two weight layouts: transformers' in memory (experts stacked) and its checkpoint's
(one tensor per expert and projection, under the names `save_pretrained` writes and SGLang loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from engines.inference.torch_engine import TorchEngine
from engines.weights import layouts
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

FAMILIES = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module", params=FAMILIES)
def moe_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_tiny_model(tmp_path_factory.mktemp(request.param), TinyModelSpec(family=request.param))


def saved_checkpoint(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")


@pytest.mark.unit
def test_the_checkpoint_layout_is_what_save_pretrained_writes(moe_path: Path, tmp_path: Path) -> None:
    """Names and values, Mixtral's `block_sparse_moe.experts.<e>.w1` and router rename included."""
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    assert layouts.holds_stacked_experts(model)
    on_disk = saved_checkpoint(model, tmp_path / "saved")
    converted = dict(layouts.CheckpointLayout(model.config)(model.named_parameters()))
    assert sorted(converted) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(converted[name], tensor), name


@pytest.mark.unit
def test_checkpoint_tensors_are_stacked_as_transformers_holds_the_model(moe_path: Path) -> None:
    """What the Megatron trainer's model layout does with mbridge's export: names, shapes and values of the HF model
    in memory, from the file `save_pretrained` wrote."""
    on_disk = load_file(moe_path / "model.safetensors")
    stacked = dict(layouts.ModelLayout(AutoConfig.from_pretrained(moe_path))(sorted(on_disk.items())))
    model = dict(AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).named_parameters())
    assert stacked.keys() == model.keys()
    for name, parameter in model.items():
        torch.testing.assert_close(stacked[name], parameter.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.unit
def test_an_incomplete_layer_of_experts_is_an_error_naming_it(moe_path: Path) -> None:
    on_disk = load_file(moe_path / "model.safetensors")
    partial = [(name, tensor) for name, tensor in sorted(on_disk.items()) if ".layers.1." not in name or (
        ".experts.3." not in name)]
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.(gate_up|down)_proj.*ended incomplete"):
        list(layouts.ModelLayout(AutoConfig.from_pretrained(moe_path))(partial))


@pytest.mark.unit
def test_the_checkpoint_layout_closes_its_source() -> None:
    """A trainer's generator finishes its collective iteration on close; the renaming must pass the close on."""
    closed = []

    def source():
        try:
            yield "model.norm.weight", torch.ones(2)
            yield "model.embed_tokens.weight", torch.ones(2, 2)
        finally:
            closed.append(True)

    hf_config = AutoConfig.for_model("qwen3_moe", vocab_size=8, hidden_size=2, num_hidden_layers=1,
                                     num_attention_heads=1, num_key_value_heads=1, head_dim=2, num_experts=2,
                                     num_experts_per_tok=1, moe_intermediate_size=2, intermediate_size=2)
    renamed = layouts.CheckpointLayout(hf_config)(source())
    assert next(renamed)[0] == "model.norm.weight"
    renamed.close()
    assert closed == [True]


@pytest.mark.unit
async def test_a_torch_engine_loads_checkpoint_names_into_its_stacked_experts(moe_path: Path, tmp_path: Path) -> None:
    """What the SGLang-compatible server relies on to take what SGLang takes: each expert written into its slice."""
    trained = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    checkpoint = saved_checkpoint(trained, tmp_path / "trained")
    engine = TorchEngine.from_pretrained(moe_path)
    try:
        await engine.update_weights(sorted(checkpoint.items()), 1)
        served = dict(engine.weights_snapshot())
        for name, parameter in trained.state_dict().items():
            assert torch.equal(served[name], parameter), name
        with pytest.raises(ValueError, match="has shape"):
            name = next(name for name in checkpoint if ".experts.0." in name)
            await engine.update_weights([(name, torch.zeros(1, 1))], 2)
        with pytest.raises(ValueError, match="is not a weight of this model"):
            await engine.update_weights([(name.replace(".experts.0.", ".experts.99."), checkpoint[name])], 2)
    finally:
        await engine.close()
