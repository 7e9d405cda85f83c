"""FP8 rollout (`--rollout-fp8`): the block-scaled format against transformers' quantiser and SGLang's dequantiser,
its error bound, a learner's push quantised on the way, and torch engines that serve it: loaded in place and
certified, deltas ending bit for bit where full pushes end, a LoRA adapter merged over the FP8 base, and a push in
the wrong precision refused by name. Both kernels: the scaled matmul that reads the FP8 bytes (`fp8_matmul`, no dense
copy kept) against the dequantised copy, on SmolLM2's ragged shapes; named adapters over either."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from engines.inference import fp8_matmul
from engines.inference.batch_invariant import _is_padded_leaf
from engines.inference.fp8_linear import Fp8Linear, serve_fp8
from engines.inference.multi_lora import MultiLora
from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol
from engines.weights import fp8
from engines.weights.base import TransferReport
from engines.weights.stream import SpecifiedTensors, record_specs, spec_of
from tests.engines.test_weights_delta import push_all

GENERATOR_SEED = 0


def _matrix(rows: int, columns: int, seed: int = GENERATOR_SEED) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    # magnitudes spread over six decades, so tiles differ in scale and some values fall to FP8's subnormals
    decades = torch.empty(rows, 1).uniform_(-4, 2, generator=generator)
    return torch.randn(rows, columns, generator=generator) * 10 ** decades


# ---------------------------------------------------------------------------------------------------- the format
@pytest.mark.unit
def test_our_quantiser_gives_transformers_bytes_and_scales() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=(128, 128))

    weight = _matrix(384, 256)
    weight[:128, 128:] = 0.0  # a tile of zeros: scale 1 on both sides
    theirs = Fp8Quantize(Quantizer())._quantize_one("layer.weight", weight)
    values, scales = fp8.quantise(weight)
    assert torch.equal(values.view(torch.uint8), theirs["layer.weight"].view(torch.uint8))
    assert torch.equal(scales, theirs["layer.weight_scale_inv"]) and scales[0, 1] == 1.0


def _sglang_block_quant_dequant(version: str):  # SGLang's function, compiled from its wheel
    from tests.engines.test_sglang_contract import SglangSource, fetch_wheel

    source = SglangSource(version, fetch_wheel(version))
    tree = source.tree("sglang/srt/layers/quantization/fp8_utils.py")
    function = next(node for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == "block_quant_dequant")
    namespace: dict[str, object] = {"torch": torch, "List": list}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "fp8_utils.py", "exec"), namespace)
    return namespace["block_quant_dequant"]


@pytest.mark.unit
@pytest.mark.parametrize("version", protocol.SUPPORTED_SGLANG)
def test_our_dequantiser_equals_sglangs_bit_for_bit_ragged_tiles_included(version: str) -> None:
    dequantise = _sglang_block_quant_dequant(version)
    weight = _matrix(300, 200)
    values, scales = fp8.quantise(weight)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fp8.dequantise(values, scales, dtype), dequantise(values, scales, [128, 128], dtype))


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(128, 128), (576, 192), (33, 1000), (1, 5)])
def test_a_dequantised_weight_is_within_fp8s_rounding_of_the_original(shape: tuple[int, int]) -> None:
    weight = _matrix(*shape)
    values, scales = fp8.quantise(weight)
    assert values.dtype == fp8.FP8 and values.shape == weight.shape
    assert scales.dtype == torch.float32 and tuple(scales.shape) == fp8.scale_shape(shape)
    error = (fp8.dequantise(values, scales, torch.float32) - weight).abs()
    # e4m3: 3 mantissa bits, so half a unit is 2^-4 of a normal value; below 2^-6 (scaled) the spacing is 2^-9
    tile_scale = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
    bound = torch.maximum(weight.abs() * 2.0 ** -4, tile_scale * 2.0 ** -10) * (1 + 1e-6)
    assert bool((error <= bound).all()), f"worst excess {(error - bound).max().item():.3g}"
    tile_max = (weight.abs() / tile_scale).max()
    assert tile_max == pytest.approx(fp8.FP8_MAX, rel=1e-6), "every tile's largest value maps to 448"


@pytest.mark.unit
def test_activations_round_per_token_and_group_of_128_features() -> None:
    inputs = _matrix(6, 300).view(2, 3, 300)
    inputs[0, 0, 128:256] *= 1e4  # one group of one token far larger: only its own scale follows
    rounded = fp8.fake_quantise_activations(inputs)
    assert rounded.shape == inputs.shape and rounded.is_contiguous()
    flat, out = inputs.reshape(-1, 300), rounded.reshape(-1, 300)
    for row in range(flat.shape[0]):
        for start in range(0, 300, 128):
            group, got = flat[row, start:start + 128], out[row, start:start + 128]
            scale = group.abs().max() / fp8.FP8_MAX
            expected = (group / scale).to(fp8.FP8).to(torch.float32) * scale
            assert torch.equal(got, expected)
    assert torch.equal(fp8.fake_quantise_activations(rounded), rounded), "rounding twice changes nothing"


@pytest.mark.unit
def test_only_decoder_projections_are_quantised(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    names = {name for name, tensor in model.named_parameters() if fp8.quantised(name, tensor.shape)}
    layers = model.config.num_hidden_layers
    assert len(names) == 7 * layers  # q, k, v, o, gate, up, down
    assert not any(part in name for name in names for part in ("embed", "lm_head", "norm", "bias"))


# ------------------------------------------------------------------------------------------- the learner's push
def _source(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    return [(name, tensor.detach()) for name, tensor in model.named_parameters()]


class Closable:
    def __init__(self, named: list[tuple[str, Tensor]]) -> None:
        self.named, self.closed = named, False

    def __iter__(self):
        return iter(self.named)

    def close(self) -> None:
        self.closed = True


@pytest.mark.unit
def test_a_quantised_push_yields_what_its_specs_say_and_closes_its_source_even_unread(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    named = _source(model)
    specs = record_specs(iter(named))
    push = fp8.quantised_push(SpecifiedTensors(specs, Closable(named)), torch.bfloat16)
    pulled = list(push)
    assert tuple(spec_of(name, tensor) for name, tensor in pulled) == push.specs
    by_name = dict(pulled)
    projection = "model.layers.0.mlp.down_proj.weight"
    assert by_name[projection].dtype == fp8.FP8 and by_name[fp8.scale_name(projection)].dtype == torch.float32
    assert by_name["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert len(pulled) == len(named) + 7 * model.config.num_hidden_layers
    source = Closable(named)
    fp8.quantised_push(SpecifiedTensors(specs, source), None).close()
    assert source.closed


# ---------------------------------------------------------------------------------------------- engines serving it
@pytest.mark.unit
def test_an_fp8_layer_computes_with_its_rounded_inputs_and_dequantised_weight_and_follows_writes() -> None:
    linear = torch.nn.Linear(200, 150, bias=True)
    layer = Fp8Linear(linear)
    assert layer.weight.dtype == fp8.FP8 and _is_padded_leaf(layer)
    inputs = torch.randn(3, 200)
    expected = torch.nn.functional.linear(fp8.fake_quantise_activations(inputs),
                                          fp8.dequantise(layer.weight, layer.weight_scale_inv, torch.float32),
                                          linear.bias)
    assert torch.equal(layer(inputs), expected)
    values, scales = fp8.quantise(torch.randn(150, 200))
    with torch.no_grad():
        layer.weight.copy_(values)
        layer.weight_scale_inv.copy_(scales)
    assert layer.refresh() and not layer.refresh()
    assert torch.equal(layer.served, fp8.dequantise(values, scales, torch.float32))


# SmolLM2-135M's projections (N, K): q/o, k/v, gate/up, down; 576 and 192 end in half tiles
SMOLLM2_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))


@pytest.mark.unit
@pytest.mark.parametrize(("shape", "block"), [*((shape, 128) for shape in SMOLLM2_SHAPES), ((150, 200), 128),
                                              ((64, 64), 32)])
def test_the_scaled_matmul_of_the_fp8_bytes_equals_the_dequantised_product(shape: tuple[int, int],
                                                                          block: int) -> None:
    """Same inputs rounded the same way, same weight: the products differ by float32 summation order only
    (measured on these shapes: at most 7e-7 of the output's largest value)."""
    out_features, in_features = shape
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_(_matrix(out_features, in_features))
    dequantised, scaled = Fp8Linear(linear, block), Fp8Linear(linear, block, kernel="scaled_mm")
    assert scaled.served is None and scaled.recipe == "rowwise" and "served" not in dict(scaled.named_buffers())
    for rows in (1, 5):
        inputs = torch.randn(2, rows, in_features)
        expected = dequantised(inputs)
        got = scaled(inputs)
        assert got.shape == expected.shape == (2, rows, out_features)
        assert (got - expected).abs().max() <= 2e-6 * expected.abs().max()
    bf16 = Fp8Linear(linear.to(torch.bfloat16), block, kernel="scaled_mm")
    inputs = torch.randn(3, in_features).bfloat16()
    exact = torch.nn.functional.linear(fp8.fake_quantise_activations(inputs.float(), block), fp8.dequantise(
        bf16.weight, bf16.weight_scale_inv, torch.float32, block), bf16.bias.float())
    got = bf16(inputs)  # float32 products rounded once to bfloat16
    assert got.dtype == torch.bfloat16 and (got.float() - exact).abs().max() <= 2 ** -7 * exact.abs().max()


@pytest.mark.unit
def test_a_scaled_matmul_layer_computes_with_the_bytes_written_into_it() -> None:
    layer = Fp8Linear(torch.nn.Linear(200, 150, bias=False), kernel="scaled_mm")
    values, scales = fp8.quantise(_matrix(150, 200, seed=4))
    with torch.no_grad():
        layer.weight.copy_(values)
        layer.weight_scale_inv.copy_(scales)
    assert layer.refresh() and layer.served is None, "nothing to re-derive"
    inputs = torch.randn(4, 200)
    expected = fp8.fake_quantise_activations(inputs) @ fp8.dequantise(values, scales, torch.float32).T
    assert (layer(inputs) - expected).abs().max() <= 2e-6 * expected.abs().max()
    assert layer.use("dequantised") == "dequantised" and torch.equal(
        layer.served, fp8.dequantise(values, scales, torch.float32))


@pytest.mark.unit
def test_the_kernel_is_chosen_by_what_the_device_runs() -> None:
    """This CPU's torch runs the row-wise recipe and refuses the block-wise one; `auto` keeps the faster dequantised
    copy on a CPU. On CUDA the operands' dimensions must be multiples of 16, and block-wise scaling needs whole
    tiles."""
    assert "rowwise" in fp8_matmul.recipes("cpu")
    assert fp8_matmul.resolve("auto", "cpu") == "dequantised"
    assert fp8_matmul.resolve("scaled_mm", "cpu") == "scaled_mm"
    with pytest.raises(ValueError, match=r"FP8 kernel 'fast' is not one of auto, scaled_mm, dequantised"):
        fp8_matmul.resolve("fast", "cpu")
    cuda = torch.device("cuda")
    assert fp8_matmul.fits("rowwise", cuda, 576, 576, 128) and fp8_matmul.fits("rowwise", cuda, 192, 1536, 128)
    assert not fp8_matmul.fits("rowwise", cuda, 150, 200, 128), "150 outputs and a last block of 72 features"
    assert fp8_matmul.fits("rowwise", torch.device("cpu"), 150, 200, 128)
    assert fp8_matmul.fits("blockwise", cuda, 1536, 512, 128) and not fp8_matmul.fits("blockwise", cuda, 576, 576,
                                                                                       128)


@pytest.mark.unit
@pytest.mark.parametrize("kernel", ["scaled_mm", "dequantised"])
def test_a_named_adapter_adds_its_product_to_an_fp8_layers_output(tiny_model_path: Path, kernel: str) -> None:
    model = _fp8_model(tiny_model_path, fp8.BLOCK, kernel)
    module = "model.layers.0.mlp.up_proj"
    layer = model.get_submodule(module)
    generator = torch.Generator().manual_seed(5)
    lora_a = torch.randn(4, layer.in_features, generator=generator)
    lora_b = torch.randn(layer.out_features, 4, generator=generator)
    adapters = MultiLora(model, max_adapters=2)
    adapters.load("a", [(f"{module}.lora_A.weight", lora_a), (f"{module}.lora_B.weight", lora_b)], scaling=2.0)
    inputs = torch.randn(2, 3, layer.in_features)
    base = layer(inputs)
    with adapters.adapter_rows(["a", None], "cpu"):
        adapted = layer(inputs)
    torch.testing.assert_close(adapted[0], base[0] + 2.0 * (inputs[0] @ lora_a.T) @ lora_b.T)
    assert torch.equal(adapted[1], base[1]), "a row without the adapter gets the base output bit for bit"


async def _push(engine: TorchEngine, versions: list[list[tuple[str, Tensor]]], *, delta_sync: bool = False,
                block: int = fp8.BLOCK) -> list[TransferReport]:
    """Each version pushed as a learner pushes it under --rollout-fp8, over one gloo group, fingerprinted."""
    specs = record_specs(iter(versions[0]))
    return await push_all(engine, versions, delta_sync=delta_sync,
                          prepare=lambda named: fp8.quantised_push(SpecifiedTensors(specs, named), None, block))


def _moved(named: list[tuple[str, Tensor]], seed: int) -> list[tuple[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, tensor + torch.randn(tensor.shape, generator=generator) * 1e-2) for name, tensor in named]


def _fp8_model(path: Path, block: int, kernel: str = "auto") -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    serve_fp8(model, block, kernel)
    return model


@pytest.mark.integration
@pytest.mark.parametrize("kernel", ["dequantised", "scaled_mm"])
async def test_an_fp8_engine_serves_the_pushed_bytes_certified_and_deltas_end_where_full_pushes_end(
        tiny_model_path: Path, kernel: str) -> None:
    block = 32  # the tiny model's 64 features make two tiles a row
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    versions = [_source(trained)]
    for seed in (1, 2, 3):
        versions.append(_moved(versions[-1], seed))
    served = {}
    for delta_sync in (False, True):
        model = _fp8_model(tiny_model_path, block, kernel)
        async with TorchEngine(model, None) as engine:
            reports = await _push(engine, versions, delta_sync=delta_sync, block=block)
        assert all(report.fingerprints is not None and report.fingerprints.ok for report in reports)
        if delta_sync:
            assert [report.delta_base for report in reports] == [None, 0, 1, 2]
        served[delta_sync] = {name: tensor.view(torch.uint8).clone() if tensor.dtype == fp8.FP8 else tensor.clone()
                              for name, tensor in model.state_dict().items()}
        last = dict(versions[-1])
        projection = "model.layers.1.self_attn.k_proj"
        values, scales = fp8.quantise(last[f"{projection}.weight"], block)
        layer = model.get_submodule(projection)
        assert torch.equal(layer.weight.view(torch.uint8), values.view(torch.uint8))
        inputs = torch.randn(3, layer.in_features)
        expected = torch.nn.functional.linear(fp8.fake_quantise_activations(inputs, block), fp8.dequantise(
            values, scales, torch.float32, block), layer.bias)  # qwen2's k_proj has a bias
        assert (layer(inputs) - expected).abs().max() <= 2e-6 * expected.abs().max(), "computes with the new bytes"
        assert (layer.served is None) == (kernel == "scaled_mm")
        assert torch.equal(model.get_parameter("model.norm.weight"), last["model.norm.weight"])
    assert served[True].keys() == served[False].keys()
    assert all(torch.equal(served[True][name], served[False][name]) for name in served[False])


@pytest.mark.integration
async def test_an_fp8_engine_refuses_a_full_precision_push_naming_the_setting(tiny_model_path: Path) -> None:
    model = _fp8_model(tiny_model_path, fp8.BLOCK)
    before = model.get_parameter("model.layers.0.self_attn.q_proj.weight").clone()
    full = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(before.shape))]
    async with TorchEngine(model, None) as engine:
        with pytest.raises(ValueError, match=r"arrives as torch.float32, served as torch.float8_e4m3fn.*rollout-fp8"):
            await engine.update_weights(full, 1)
    assert torch.equal(model.get_parameter("model.layers.0.self_attn.q_proj.weight").view(torch.uint8),
                       before.view(torch.uint8)), "nothing was written"


@pytest.mark.integration
@pytest.mark.parametrize("kernel", ["dequantised", "scaled_mm"])
async def test_a_lora_adapter_merges_over_the_dequantised_fp8_base(tiny_model_path: Path, kernel: str) -> None:
    """Over the scaled matmul too: a layer an adapter merges into takes a dense copy then, the others keep none."""
    model = _fp8_model(tiny_model_path, fp8.BLOCK, kernel)
    module = "model.layers.0.mlp.up_proj"
    layer = model.get_submodule(module)
    base = fp8.dequantise(layer.weight, layer.weight_scale_inv, torch.float32)
    bytes_before = layer.weight.view(torch.uint8).clone()
    generator = torch.Generator().manual_seed(3)
    lora_a = torch.randn(4, layer.in_features, generator=generator) * 0.1
    lora_b = torch.randn(layer.out_features, 4, generator=generator) * 0.1
    async with TorchEngine(model, None, lora_scaling=2.0) as engine:
        await engine.update_weights([(f"{module}.lora_A.weight", lora_a), (f"{module}.lora_B.weight", lora_b)], 1)
    torch.testing.assert_close(layer.served, base + 2.0 * lora_b @ lora_a)
    assert torch.equal(layer.weight.view(torch.uint8), bytes_before), "the FP8 base is never written"
    assert layer.recipe is None and layer.use(kernel) == "dequantised", "the merge stays where it was made"
    other = model.get_submodule("model.layers.0.mlp.down_proj")
    assert (other.served is None) == (kernel == "scaled_mm")


@pytest.mark.integration
async def test_an_engine_on_the_scaled_matmul_decodes_what_the_dequantised_one_does(tiny_model_path: Path) -> None:
    from engines.inference.base import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for kernel in ("dequantised", "scaled_mm"):
        async with TorchEngine.from_pretrained(tiny_model_path, fp8=kernel) as engine:
            layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
            assert layers and all((layer.served is None) == (kernel == "scaled_mm") for layer in layers)
            ids = engine.tokenizer.encode("12+34=")
            outputs[kernel] = (await engine.generate(GenerateRequest("r", ids, params)))[0]
    assert outputs["scaled_mm"].output_ids == outputs["dequantised"].output_ids
    assert outputs["scaled_mm"].log_probs == pytest.approx(outputs["dequantised"].log_probs, abs=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize(("settings", "refusal"), [
    ({"rollout_engine": "tests.engines.test_fp8:no_engine"},
     "the plugin engine 'tests.engines.test_fp8:no_engine' does not serve FP8 weights; --rollout-engine torch or "
     "sglang does"),
    ({"policies": {"a": {}, "b": {}}, "lora_rank": 4, "rollout_engine": "sglang"},
     "--rollout-fp8 with LoRA on SGLang servers"),
    ({"rollout_engine": "sglang", "lora_rank": 4}, "--rollout-fp8 with LoRA on SGLang servers: they load the adapter"),
])
def test_runs_that_cannot_roll_out_in_fp8_are_refused_at_start(settings: dict[str, object], refusal: str) -> None:
    from actors.config import build_config

    with pytest.raises(ValueError, match=re.escape(refusal)):
        build_config({"rollout_fp8": True, "hf_checkpoint": "model", **settings})


@pytest.mark.integration
@pytest.mark.parametrize("kernel", ["dequantised", "scaled_mm"])
async def test_an_fp8_engine_serves_several_policies_adapters_each_row_its_own(tiny_model_path: Path,
                                                                              kernel: str) -> None:
    """Several policies rolled out in FP8 on one torch engine: a batch mixing two named adapters and the base decodes
    for each row what that row's adapter (or none) decodes alone, over the same FP8 layers."""
    from engines.inference.base import GenerateRequest, SamplingParams
    from tests.support.adapters import random_adapter

    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    async with TorchEngine.from_pretrained(tiny_model_path, fp8=kernel, adapters=("a", "b"),
                                           lora_scaling=2.0) as engine:
        for name, seed in (("a", 1), ("b", 2)):
            await engine.update_weights(random_adapter(engine.model, 4, seed, scale=0.5), 1, adapter=name)
        ids = engine.tokenizer.encode("12+34=")

        async def greedy(request_id: str, adapter: str | None) -> list[int]:
            (output,) = await engine.generate(GenerateRequest(request_id, ids, params, adapter=adapter))
            return list(output.output_ids)

        alone = {adapter: await greedy(f"alone-{adapter}", adapter) for adapter in ("a", "b", None)}
        await engine.pause()
        mixed = [asyncio.ensure_future(greedy(f"mixed-{adapter}", adapter)) for adapter in ("a", "b", None)]
        await asyncio.sleep(0)
        await engine.resume()
        together = dict(zip(("a", "b", None), await asyncio.gather(*mixed), strict=True))
    assert together == alone
    assert alone["a"] != alone[None] or alone["b"] != alone[None], "the adapters changed nothing"
