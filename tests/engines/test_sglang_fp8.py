"""FP8 rollout on SGLang servers: the FP8 checkpoint a server starts on (converted from the run's checkpoint, bytes as
the learner pushes them), SGLang's whole-tile shape rule, the check of what an attached server serves, the stand-in
serving the stored bytes, and FP8 pushes over the SGLang transports, certified by the server's own checksum.
(Contract tests against SGLang's source: tests/engines/test_sglang_contract.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engines import checkpoint_config, fp8_checkpoint
from engines.checkpoint_config import Fp8CheckpointError
from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.fp8_linear import Fp8Linear
from engines.inference.model_facts import load_model_folder
from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol, tensor_payload
from engines.sglang.client import SglangEngine
from engines.sglang.fp8_serving import attached_problem, block_shape_problems, launch_checkpoint
from engines.sglang.weights import SglangWeightLoader, SglangWeightSender
from engines.weights import fp8
from engines.weights.base import TransferReport
from engines.weights.fingerprint import FingerprintCheck
from tests.engines.test_sglang_weight_checks import push
from tools.standins.sglang_server import checksum
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

# Every projection a whole number of 128-tiles: q/k/v 128 wide (4 heads of 32, as many kv heads), the MLP 256.
WHOLE_TILES = TinyModelSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
ENGINE = "rollout-0-0"
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}


@pytest.fixture(scope="module")
def source(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, WHOLE_TILES)


@pytest.fixture(scope="module")
def converted(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fp8_checkpoint.convert(source, tmp_path_factory.mktemp("fp8") / "model")


def _source_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------------------ the checkpoint
@pytest.mark.unit
def test_a_converted_checkpoint_stores_what_the_learner_pushes_byte_for_byte(source: Path, converted: Path) -> None:
    original, stored = _source_weights(source), _source_weights(converted)
    projections = [name for name, tensor in original.items() if fp8.quantised(name, tensor.shape)]
    assert len(projections) == 7 * WHOLE_TILES.num_hidden_layers
    for name, tensor in original.items():
        if name in projections:
            values, scales = fp8.quantise(tensor)
            assert torch.equal(stored[name].view(torch.uint8), values.view(torch.uint8)), name
            assert torch.equal(stored[fp8.scale_name(name)], scales), name
        else:
            assert torch.equal(stored[name], tensor), f"{name} is stored as it was"
    assert len(stored) == len(original) + len(projections)
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization_config"] == fp8.quantization_config()
    assert (converted / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert not list(converted.parent.glob(".*partial*")), "no staging folder left behind"


@pytest.mark.unit
def test_conversion_refuses_a_quantised_source_a_folder_without_safetensors_and_an_existing_target(
        converted: Path, source: Path, tmp_path: Path) -> None:
    with pytest.raises(Fp8CheckpointError, match="already an FP8 checkpoint"):
        fp8_checkpoint.convert(converted, tmp_path / "again")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text("{}")
    with pytest.raises(Fp8CheckpointError, match=r"no \*\.safetensors weights"):
        fp8_checkpoint.convert(tmp_path / "bin", tmp_path / "out")
    with pytest.raises(Fp8CheckpointError, match="already exists"):
        fp8_checkpoint.convert(source, converted)


@pytest.mark.unit
@pytest.mark.parametrize(("quantization", "refusal"), [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size is None"),
    ({"quant_method": "fp8", "weight_block_size": [128, 64]}, r"weight_block_size is \[128, 64\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
])
def test_a_checkpoint_in_another_quantisation_is_refused_by_name(quantization: dict, refusal: str) -> None:
    with pytest.raises(Fp8CheckpointError, match=refusal):
        checkpoint_config.checkpoint_block({"quantization_config": quantization}, "MODEL")
    assert checkpoint_config.checkpoint_block({"quantization_config": fp8.quantization_config()}, "MODEL") == 128


@pytest.mark.unit
def test_a_run_converts_its_checkpoint_once_and_again_only_when_the_source_changed(
        source: Path, converted: Path, tmp_path: Path) -> None:
    copy = tmp_path / "source"
    copy.mkdir()
    for file in source.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    cache = tmp_path / "cache"
    first = launch_checkpoint(copy, tp_size=1, cache=cache)
    assert first.parent == cache and (first / "config.json").is_file()
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert launch_checkpoint(copy, tp_size=1, cache=cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written, "not converted again"
    assert launch_checkpoint(converted, tp_size=1, cache=cache) == converted, "an FP8 checkpoint is served as it is"
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert launch_checkpoint(copy, tp_size=1, cache=cache) != first


@pytest.mark.unit
def test_the_converter_command_writes_the_checkpoint_or_says_in_one_line_why_not(
        source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools import convert_fp8

    assert convert_fp8.main([str(source), str(tmp_path / "out"), "--tp-size", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert convert_fp8.main([str(source), str(tmp_path / "tp4"), "--tp-size", "4"]) == 1
    assert "gate_proj.weight: output size 64 per tensor-parallel shard (tp 4)" in capsys.readouterr().err
    assert not (tmp_path / "tp4").exists()


# ------------------------------------------------------------------------------------------ SGLang's tile rule
@pytest.mark.unit
def test_sglang_s_tile_rule_refuses_smollm2_naming_each_tensor_and_its_sizes() -> None:
    problems = block_shape_problems(SMOLLM2, 1, "SmolLM2")
    assert len(problems) == 1
    assert re.search(r"q_proj\.weight: output size 576 per tensor-parallel shard \(tp 1\) is not divisible by the "
                     r"FP8 tile 128", problems[0])
    assert "k_proj.weight: output size 192" in problems[0] and "v_proj.weight: output size 192" in problems[0]
    assert "o_proj" not in problems[0], "a row-parallel layer's input is checked only when it is split"
    assert "--rollout-engine torch" in problems[0]


@pytest.mark.unit
@pytest.mark.parametrize(("tp_size", "refused"), [
    (1, []),
    (2, ["gate_proj.weight: output size 320", "up_proj.weight: output size 320", "down_proj.weight: input size 320"]),
    (4, ["gate_proj.weight: output size 160", "down_proj.weight: input size 160"]),
])
def test_sglang_s_tile_rule_follows_the_tensor_parallel_shards(tp_size: int, refused: list[str]) -> None:
    # 8 heads of 128, 2 kv heads (replicated once the ranks outnumber them), an MLP 640 wide
    config = {"hidden_size": 1024, "intermediate_size": 640, "num_attention_heads": 8, "num_key_value_heads": 2}
    problems = block_shape_problems(config, tp_size, "MODEL")
    assert bool(problems) == bool(refused)
    for phrase in refused:
        assert phrase in problems[0]
    if problems:
        assert "q_proj" not in problems[0] and "k_proj" not in problems[0], "kv heads replicate, never split below one"
        assert "o_proj" not in problems[0]


@pytest.mark.unit
def test_a_mixture_of_experts_model_and_a_config_that_does_not_shard_are_refused() -> None:
    assert "mixture-of-experts" in block_shape_problems({**SMOLLM2, "num_experts": 8}, 1, "MODEL")[0]
    assert "does not split over 2" in block_shape_problems({**SMOLLM2, "num_attention_heads": 9}, 2, "MODEL")[0]


@pytest.mark.unit
def test_preflight_refuses_an_fp8_sglang_run_of_a_model_sglang_cannot_tile(tmp_path: Path, source: Path) -> None:
    from actors.config import build_config
    from actors.config.preflight import preflight

    ragged = tmp_path / "ragged"
    ragged.mkdir()
    (ragged / "config.json").write_text(json.dumps(SMOLLM2))
    settings = {"rollout_fp8": True, "rollout_engine": "sglang"}
    problems = preflight(build_config({**settings, "hf_checkpoint": str(ragged)}), {"rollout": 1})
    assert len(problems) == 1 and f"--rollout-fp8 --hf-checkpoint {ragged}" in problems[0]
    assert "q_proj.weight: output size 576" in problems[0]
    assert preflight(build_config({**settings, "hf_checkpoint": str(source)}), {"rollout": 1}) == []
    torch_run = build_config({"rollout_fp8": True, "rollout_engine": "torch", "hf_checkpoint": str(ragged)})
    assert preflight(torch_run, {"rollout": 1}) == [], "the torch engine serves ragged tiles"


# ------------------------------------------------------------------------- an FP8 --hf-checkpoint, as slime gives it
@pytest.mark.unit
def test_a_learner_trains_from_an_fp8_checkpoint_dequantised_with_its_scales(
        source: Path, converted: Path, tmp_path: Path) -> None:
    """slime rolls out in FP8 by pointing --hf-checkpoint at an FP8 folder. transformers cannot load one without a
    GPU (and refuses ragged tiles), so a learner trains from its dequantised copy, made once."""
    plain = fp8_checkpoint.trainable(converted, cache=tmp_path)
    assert plain != converted and fp8_checkpoint.trainable(converted, cache=tmp_path) == plain, "made once"
    assert fp8_checkpoint.trainable(source, cache=tmp_path) == source, "an unquantised folder is its own"
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    stored, weights = _source_weights(converted), _source_weights(plain)
    assert not any(name.endswith(fp8.SCALE_SUFFIX) for name in weights)
    projection = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(weights[projection], fp8.dequantise(stored[projection], stored[fp8.scale_name(projection)],
                                                           torch.float32))
    assert torch.equal(weights["model.norm.weight"], stored["model.norm.weight"])
    from actors.config import build_config
    from actors.learner.trainer_factory import build_trainer

    trainer = build_trainer(build_config({"hf_checkpoint": str(converted)}))
    trained = dict(trainer.named_tensors())
    assert torch.equal(trained[projection], weights[projection])
    trainer.close()


@pytest.mark.unit
def test_an_fp8_checkpoint_rolls_out_in_fp8_without_the_flag_and_is_checked_as_such(
        source: Path, converted: Path) -> None:
    from actors.config import build_config
    from actors.config.preflight import preflight
    from actors.config.rollout_fp8 import rolls_out_fp8

    config = build_config({"hf_checkpoint": str(converted)})
    assert rolls_out_fp8(config.weights, str(converted)) and not rolls_out_fp8(config.weights, str(source))
    plugin = build_config({"hf_checkpoint": str(converted), "rollout_engine": "tests.engines.test_fp8:no_engine"})
    problems = [problem for problem in preflight(plugin, {"rollout": 1}) if "FP8" in problem]
    assert problems == [f"--hf-checkpoint {converted} is an FP8 checkpoint, so the run rolls out in FP8: the plugin "
                        "engine 'tests.engines.test_fp8:no_engine' does not serve FP8 weights; --rollout-engine torch "
                        "or sglang does"], problems


# ------------------------------------------------------------------------------------ the stand-in serving them
@pytest.mark.unit
def test_an_fp8_checkpoint_loads_its_stored_bytes_into_fp8_layers_not_quantised_again(converted: Path) -> None:
    model, _, _ = load_model_folder(converted, dtype=torch.float32, device="cpu")
    stored = _source_weights(converted)
    layers = {name: module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}
    assert len(layers) == 7 * WHOLE_TILES.num_hidden_layers
    for name, layer in layers.items():
        assert torch.equal(layer.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(layer.weight_scale_inv, stored[f"{name}.weight_scale_inv"]), name
        assert torch.equal(layer.served, fp8.dequantise(layer.weight, layer.weight_scale_inv, torch.float32))
    assert torch.equal(model.get_parameter("model.norm.weight"), stored["model.norm.weight"])


@pytest.mark.unit
def test_the_stand_in_checksums_an_fp8_weight_dequantised_as_sglang_does(converted: Path) -> None:
    model, _, _ = load_model_folder(converted, dtype=torch.float32, device="cpu")
    tensors = checksum.checked_tensors(model, protocol.SUPPORTED_SGLANG[-1], skip=["q_proj"])
    name = "model.layers.0.self_attn.q_proj"
    layer = model.get_submodule(name)
    assert f"{name}.weight_scale_inv" not in tensors and f"{name}.served" not in tensors
    assert torch.equal(tensors[f"{name}.weight"],
                       fp8.dequantise(layer.weight, layer.weight_scale_inv, torch.bfloat16)), "skip list ignored too"


@pytest.mark.unit
def test_fp8_tensors_and_their_scales_cross_the_colocated_payload_unchanged() -> None:
    values, scales = fp8.quantise(torch.randn(256, 128))
    decoded = dict(tensor_payload.decode_named_tensors(tensor_payload.encode_named_tensors(
        [("w", values), ("w_scale_inv", scales)])))
    assert decoded["w"].dtype == fp8.FP8 and torch.equal(decoded["w"].view(torch.uint8), values.view(torch.uint8))
    assert decoded["w_scale_inv"].dtype == torch.float32 and torch.equal(decoded["w_scale_inv"], scales)


@pytest.mark.unit
def test_fp8_tensors_and_their_scales_cross_the_disk_transport_unchanged(tmp_path: Path) -> None:
    from engines.weights import disk_files
    from engines.weights.stream import spec_of

    values, scales = fp8.quantise(torch.randn(256, 128))
    named = [("w", values), ("w_scale_inv", scales)]
    writer = disk_files.VersionWriter(tmp_path, 1, buckets=1)
    writer.write(0, named)
    read = dict(disk_files.read_bucket(writer.path, 0, 1, [spec_of(name, tensor) for name, tensor in named]))
    assert read["w"].dtype == fp8.FP8 and torch.equal(read["w"].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(read["w_scale_inv"], scales)


# --------------------------------------------------------------------------------------------- attached servers
@pytest.fixture(scope="module")
def fp8_server(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangEngine]:
    """The stand-in as a --rollout-fp8 rollout worker launches it: on the conversion of --hf-checkpoint."""
    from actors.config import build_config
    from actors.rollout.engine_factory import sglang_engine

    cache = os.environ.get(fp8_checkpoint.CACHE_ENV)
    os.environ[fp8_checkpoint.CACHE_ENV] = str(tmp_path_factory.mktemp("fp8-cache"))
    config = build_config({"rollout_fp8": True, "rollout_engine": "sglang", "hf_checkpoint": str(source),
                           "sglang_server_module": "tools.standins.sglang_server", "weight_transfer_timeout": 20})
    engine = sglang_engine(config, ENGINE)  # its client is used by no test: each opens its own
    yield engine
    assert engine.server is not None
    engine.server.stop()
    os.environ.pop(fp8_checkpoint.CACHE_ENV)
    if cache is not None:
        os.environ[fp8_checkpoint.CACHE_ENV] = cache


@pytest.mark.integration
def test_an_attached_server_must_serve_an_fp8_checkpoint(fp8_server: SglangEngine) -> None:
    assert fp8_server.server is not None
    served = Path(fp8_server.server.spec.model_path)
    assert checkpoint_config.is_fp8(json.loads((served / "config.json").read_text())), "launched on the conversion"
    assert attached_problem(fp8_server.url, timeout_s=10) is None
    config = json.loads((served / "config.json").read_text())
    try:  # the same server now reports a folder whose config is unquantised
        (served / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                        if k != "quantization_config"}))
        problem = attached_problem(fp8_server.url, timeout_s=10)
    finally:
        (served / "config.json").write_text(json.dumps(config, indent=2))
    assert problem is not None and f"serves {served}, an unquantised checkpoint" in problem
    assert "python -m tools.convert_fp8" in problem


# ------------------------------------------------------------------------------------------------ end to end
def _trained(source: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    return [(name, tensor.detach() + torch.randn(tensor.shape, generator=generator) * 0.02)
            for name, tensor in model.state_dict().items()]


@pytest.mark.integration
async def test_fp8_pushes_over_sglang_s_distributed_update_are_served_byte_for_byte_and_certified(
        fp8_server: SglangEngine, converted: Path, source: Path) -> None:
    """A real sender pushes three versions as a --rollout-fp8 learner does (projections quantised as they go out),
    one broadcast per tensor into the stand-in a --rollout-fp8 worker launched: SGLang's checksum of what it
    serves certifies every push after the first, and equals, tensor by tensor, that of an engine holding exactly
    `fp8.quantise` of the last version; its greedy tokens are that engine's."""
    client = SglangEngine(fp8_server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", bucket_bytes=256 * 1024, timeout_s=30)
    loader = SglangWeightLoader(client, ENGINE)
    reference = TorchEngine.from_pretrained(converted)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    try:
        reports = []
        for version, seed in ((1, 1), (2, 2), (3, 3)):
            pushed = list(fp8.quantised_stream(_trained(source, seed), None))
            reports.append(await push(sender, [loader], pushed, version, fresh=version == 1))
        assert all(isinstance(report, TransferReport) for report in reports)
        assert "first push, one engine" in reports[0].fingerprints.unchecked[ENGINE]
        assert [report.fingerprints for report in reports[1:]] == [FingerprintCheck("xxh3", matched=(ENGINE,))] * 2
        await reference.update_weights(pushed, 3)
        layer = reference.model.get_submodule("model.layers.1.mlp.down_proj")
        values, scales = fp8.quantise(dict(_trained(source, 3))["model.layers.1.mlp.down_proj.weight"])
        assert torch.equal(layer.weight.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, scales)
        served = await client.weight_checksum()
        expected = checksum.checksum_answer(reference.model, protocol.SUPPORTED_SGLANG[-1])
        assert served is not None and dict(served.tensors) == expected["ranks"][0]["checksums"]
        prompt = [7, 21, 33, 4, 18]
        ours, theirs = await asyncio.gather(reference.generate(GenerateRequest("a", prompt, greedy)),
                                            client.generate(GenerateRequest("a", prompt, greedy)))
        assert theirs[0].output_ids == ours[0].output_ids and theirs[0].versions == [3] * 8
    finally:
        sender.close()
        await reference.close()
        await client.close()
