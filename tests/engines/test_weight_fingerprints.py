"""Weight fingerprints: exact, position- and dtype-aware prints on both devices' algorithms, and real pushes over
gloo into a torch engine that either serve what was sent (the push commits) or not (the push fails naming the
engine and the tensor): a tensor altered after its load, an adapter never merged, an engine that cannot tell."""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
import torch
import xxhash
from torch import Tensor
from transformers import AutoModelForCausalLM

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.lora_merge import AdapterMerger
from engines.inference.served_weights import ServedWeights
from engines.inference.torch_engine import TorchEngine
from engines.weights import fingerprint as fp
from engines.weights.base import TransferReport, WeightsDiffer
from engines.weights.fingerprint import (
    ALGORITHMS,
    FingerprintCheck,
    FingerprintPlan,
    ServedPrints,
    check_served,
    comparable_dtype,
    fingerprint,
)
from engines.weights.manifest import Manifest, TensorSpec
from engines.weights.transport import SenderOptions, resolve_transport


# ------------------------------------------------------------------------------------------------ the prints
@pytest.mark.unit
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_a_print_is_a_function_of_the_bits_and_one_flipped_bit_changes_it(algorithm: str, dtype: torch.dtype) -> None:
    values = torch.randn(7, 13, generator=torch.Generator().manual_seed(0)) * 50
    tensor = values.to(dtype)
    assert fingerprint(tensor, algorithm) == fingerprint(tensor.clone(), algorithm)
    assert fingerprint(tensor, algorithm) == fingerprint(tensor.t().contiguous().t(), algorithm)  # layout aside
    flipped = tensor.clone()
    flipped.view(-1).view(torch.uint8)[5] ^= 1  # one bit of one element
    assert fingerprint(flipped, algorithm) != fingerprint(tensor, algorithm)


@pytest.mark.unit
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_print_sees_where_each_value_is_and_what_shape_and_dtype_hold_it(algorithm: str) -> None:
    tensor = torch.arange(12, dtype=torch.float32)
    swapped = tensor.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert fingerprint(swapped, algorithm) != fingerprint(tensor, algorithm)
    assert fingerprint(tensor.view(3, 4), algorithm) != fingerprint(tensor.view(4, 3), algorithm)
    assert fingerprint(tensor.view(torch.int32), algorithm) != fingerprint(tensor, algorithm)
    assert fingerprint(torch.empty(0), algorithm) != fingerprint(torch.empty(0, 3), algorithm)


@pytest.mark.unit
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_wider_copy_of_pushed_values_prints_as_the_pushed_ones_in_the_wire_dtype(algorithm: str) -> None:
    sent = torch.randn(300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    served = sent.to(torch.float32)  # an engine keeping float32 weights fed bfloat16 ones
    assert fingerprint(served, algorithm, dtype=torch.bfloat16) == fingerprint(sent, algorithm)
    assert fingerprint(served, algorithm) != fingerprint(sent, algorithm)


@pytest.mark.unit
def test_the_device_sum_folds_every_chunk_and_a_change_in_the_last_one_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "CHUNK_WORDS", 64)
    monkeypatch.setattr(fp, "_weights_cache", {})
    tensor = torch.randn(1000, generator=torch.Generator().manual_seed(2))  # 2,000 words: 32 chunks
    changed = tensor.clone()
    changed[-1] += 1.0
    assert fingerprint(changed, "wsum") != fingerprint(tensor, "wsum")
    halves = [tensor[:500], tensor[500:]]  # the same words split differently are a different tensor
    assert fingerprint(torch.cat(halves), "wsum") == fingerprint(tensor, "wsum")


@pytest.mark.unit
def test_each_print_is_its_documented_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    """XXH3-64 of the bytes seeded with the XXH3-64 of the header; the weighted words summed per chunk and folded,
    the header's term added on the host (what both ends must compute alike, whatever the device does)."""
    monkeypatch.setattr(fp, "CHUNK_WORDS", 4)
    monkeypatch.setattr(fp, "_weights_cache", {})
    tensor = torch.randn(3, 3, generator=torch.Generator().manual_seed(3))  # 36 bytes: 18 words, 5 chunks
    header, raw = b"torch.float32(3, 3)", tensor.numpy().tobytes()
    seeded = xxhash.xxh3_64_intdigest(raw, xxhash.xxh3_64_intdigest(header)) & 0x7FFF_FFFF_FFFF_FFFF
    assert fingerprint(tensor, "xxh3") == seeded
    p, words = (1 << 31) - 1, [int.from_bytes(raw[i:i + 2], "little") for i in range(0, len(raw), 2)]
    total = zlib.crc32(header) % p
    for start in range(0, len(words), 4):
        chunk = sum(word * ((position * 2654435761) % (1 << 24) | 1)
                    for position, word in enumerate(words[start:start + 4]))
        total = (total * 1_000_003 + chunk % p) % p
    assert fingerprint(tensor, "wsum") == total


@pytest.mark.unit
def test_a_load_waits_for_a_fingerprint_under_way_which_reads_the_weights_before_it(tiny_model_path: Path) -> None:
    """The engine fingerprints beside generation, on another thread: a load that arrives meanwhile must not land
    in the middle of it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    served = ServedWeights(model, lora_scaling=None, max_adapters=1)
    name = "model.layers.0.mlp.down_proj.weight"
    specs = (TensorSpec(name, torch.float32, tuple(model.get_parameter(name).shape)),)
    before = model.get_parameter(name).detach().clone()
    reading, release = threading.Event(), threading.Event()
    prints_of = served._fingerprints

    def slow_prints(*args: object) -> ServedPrints:
        reading.set()
        assert release.wait(10)
        return prints_of(*args)  # type: ignore[arg-type]

    served._fingerprints = slow_prints  # type: ignore[method-assign]
    answer: list[ServedPrints] = []
    printing = threading.Thread(target=lambda: answer.append(served.fingerprints(specs, FingerprintPlan("xxh3"))))
    printing.start()
    assert reading.wait(10)
    loading = threading.Thread(target=served.load, args=([(name, before + 1.0)],))
    loading.start()
    loading.join(0.3)
    assert loading.is_alive()  # held back while the fingerprint reads
    release.set()
    printing.join(10)
    loading.join(10)
    assert answer[0].prints == {name: fingerprint(before, "xxh3")}
    assert torch.equal(model.get_parameter(name), before + 1.0)


@pytest.mark.unit
@pytest.mark.parametrize(("wire", "served", "comparable"), [
    (torch.bfloat16, torch.bfloat16, True),
    (torch.bfloat16, torch.float32, True),
    (torch.float16, torch.float32, True),
    (torch.float32, torch.bfloat16, False),  # the engine rounded what it received
    (torch.float16, torch.bfloat16, False),  # neither holds the other
    (torch.int64, torch.int32, False),
])
def test_an_engine_can_reproduce_the_wire_bits_only_from_the_same_or_a_wider_float(
        wire: torch.dtype, served: torch.dtype, comparable: bool) -> None:
    assert comparable_dtype(wire, served) is comparable


@pytest.mark.unit
def test_an_unknown_algorithm_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"fingerprint algorithm: expected one of .*'md5'"):
        fingerprint(torch.zeros(1), "md5")


@pytest.mark.unit
def test_served_prints_travel_as_json_and_unreadable_ones_are_named() -> None:
    prints = ServedPrints({"a": 1, "b": 2**62}, {"c": "served as torch.bfloat16, sent as torch.float32"})
    assert ServedPrints.decode(prints.encode()) == prints
    with pytest.raises(ValueError, match="served fingerprints: unreadable"):
        ServedPrints.decode(b'{"prints": {"a": "x"}, "unchecked": {}}')


@pytest.mark.unit
def test_each_engine_is_matched_differing_in_named_tensors_or_unchecked_with_the_reason() -> None:
    sent = {"a": 1, "b": 2, "c": 3}
    check = check_served("xxh3", sent, {
        "good": ServedPrints({"a": 1, "b": 2, "c": 3}),
        "bad": ServedPrints({"a": 1, "b": 9}),  # c absent: not served as sent either
        "narrow": ServedPrints({"a": 1, "b": 2}, {"c": "served as torch.bfloat16, sent as torch.float32"}),
        "plugin": "its engine cannot fingerprint the weights it serves",
    })
    assert check.matched == ("good",) and check.differ == {"bad": ["b", "c"]} and not check.ok
    assert set(check.unchecked) == {"narrow", "plugin"} and "c (served as torch.bfloat16" in check.unchecked["narrow"]
    assert "bad serves other bits in b, c" in check.describe()


@pytest.mark.unit
def test_the_manifest_carries_the_algorithm_and_refuses_one_it_does_not_know() -> None:
    manifest = Manifest(version=3, bucket_bytes=64, direct_bytes=64,
                        tensors=(TensorSpec("w", torch.float32, (2,)),), fingerprint="xxh3")
    assert Manifest.decode(manifest.encode()) == manifest
    bad = manifest.encode().replace(b'"xxh3"', b'"crc"')
    with pytest.raises(ValueError, match="weight manifest: fingerprint must be one of"):
        Manifest.decode(bad)


def test_the_manifest_carries_the_stride_and_refuses_one_below_one() -> None:
    manifest = Manifest(version=5, bucket_bytes=64, direct_bytes=64, tensors=(TensorSpec("w", torch.float32, (2,)),),
                        fingerprint="xxh3", fingerprint_stride=4)
    assert Manifest.decode(manifest.encode()) == manifest
    assert manifest.fingerprint_plan() == FingerprintPlan("xxh3", stride=4, version=5)
    with pytest.raises(ValueError, match="fingerprint_stride must be an integer >= 1, got 0"):
        Manifest.decode(manifest.encode().replace(b'"fingerprint_stride":4', b'"fingerprint_stride":0'))


# ------------------------------------------------------------------------------------- fingerprinting rows
def _prints(plan: FingerprintPlan, named: dict[str, Tensor]) -> dict[str, int]:
    prints = plan.prints()
    for name, tensor in named.items():
        prints.add(name, tensor)
    return prints.values()


@pytest.mark.unit
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_strided_push_sees_a_changed_row_at_the_push_whose_rows_hold_it_and_stride_pushes_see_every_row(
        algorithm: str) -> None:
    weights = {"matrix": torch.randn(10, 6, generator=torch.Generator().manual_seed(0)), "norm": torch.ones(10)}
    seen_at: dict[int, list[int]] = {}
    for row in range(10):
        altered = {**weights, "matrix": weights["matrix"].clone()}
        altered["matrix"][row, 3] += 1e-3
        seen_at[row] = [version for version in range(4)
                        if _prints(FingerprintPlan(algorithm, 4, version), altered)["matrix"]
                        != _prints(FingerprintPlan(algorithm, 4, version), weights)["matrix"]]
    slices = [range(i * 10 // 4, (i + 1) * 10 // 4) for i in range(4)]  # rows 0-1, 2-4, 5-6, 7-9
    assert seen_at == {row: [i for i, rows in enumerate(slices) if row in rows] for row in range(10)}
    assert all(len(versions) == 1 for versions in seen_at.values())  # each row by one of 4 consecutive pushes
    every = FingerprintPlan(algorithm, 1, 7)
    assert _prints(every, weights) == fp.fingerprint_all(weights.items(), algorithm)  # stride 1: every byte
    norm = {**weights, "norm": weights["norm"].clone()}
    norm["norm"][9] = 2.0  # one dimension: always whole
    assert all(_prints(FingerprintPlan(algorithm, 4, v), norm)["norm"] != _prints(FingerprintPlan(algorithm, 4, v),
               weights)["norm"] for v in range(4))


@pytest.mark.unit
def test_a_push_covers_every_full_tensor_and_its_share_of_the_adapted_layers_which_stride_pushes_complete() -> None:
    layers = [f"model.layers.{i}.mlp.up_proj" for i in range(5)]
    specs = [TensorSpec("model.norm.weight", torch.float32, (8,))] + [
        TensorSpec(f"{layer}.lora_{factor}.weight", torch.float32, (4, 8)) for layer in layers for factor in "AB"]
    covered = {version: [spec.name for spec in FingerprintPlan("xxh3", 2, version).covered(specs)]
               for version in (0, 1)}
    assert covered[0] == ["model.norm.weight"] + [f"{layers[i]}.lora_{f}.weight" for i in (0, 2, 4) for f in "AB"]
    assert covered[1] == ["model.norm.weight"] + [f"{layers[i]}.lora_{f}.weight" for i in (1, 3) for f in "AB"]
    assert FingerprintPlan("xxh3", 1, 5).covered(specs) == tuple(specs)


@pytest.mark.unit
def test_a_tensor_never_loaded_differs_in_every_pushs_rows_and_a_bad_stride_is_refused() -> None:
    old = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    new = old + 0.01
    assert all(_prints(FingerprintPlan("xxh3", 16, v), {"w": old}) != _prints(FingerprintPlan("xxh3", 16, v),
               {"w": new}) for v in range(16))
    with pytest.raises(ValueError, match="fingerprint stride: expected an int >= 1, got 0"):
        FingerprintPlan("xxh3", 0)


# ------------------------------------------------------------------------------- real pushes into an engine
def _perturbed(model: torch.nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, (tensor.detach() + torch.randn(tensor.shape, generator=generator) * 0.05).to(dtype))
            for name, tensor in model.named_parameters()]


async def _push(engine: TorchEngine, pushed: list[tuple[str, Tensor]], *, version: int = 7,
                dtype: torch.dtype | None = None, backend: str = "gloo", stride: int = 1,
                ) -> tuple[TransferReport | WeightsDiffer, int | None]:
    """One fingerprinted push from this process to `engine`: the report (or the error) and what the sender then
    holds as committed."""
    transport = resolve_transport("torch_distributed")
    sender = transport.make_sender(SenderOptions(host="127.0.0.1", backend=backend, timeout_s=30.0,
                                                 fingerprint_stride=stride))
    loader = transport.make_loader(engine, "rollout-0", structlog.get_logger())
    try:
        group = sender.open_group(["learner", "rollout-0"]).to_dict()
        loading = asyncio.create_task(loader.apply(group, version, 30.0))
        await asyncio.to_thread(sender.wait_for_receivers)
        try:
            outcome: TransferReport | WeightsDiffer = await asyncio.to_thread(
                sender.send, iter(pushed), version, dtype=dtype, fingerprint=True)
        except WeightsDiffer as differ:
            outcome = differ
        await loading
        return outcome, sender.committed_version
    finally:
        loader.close()
        sender.close()


def _after_load(engine: TorchEngine, sabotage: Callable[[], None]) -> None:
    """Run `sabotage` on the engine's thread right after each load: what a buggy load path would leave."""
    load = engine._load_weights

    def load_then_sabotage(named: Iterator[tuple[str, Tensor]], version: int, adapter: str | None) -> None:
        load(named, version, adapter)
        sabotage()

    engine._load_weights = load_then_sabotage  # type: ignore[method-assign]


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["gloo", "shm"])
async def test_a_push_the_engine_serves_as_sent_commits_with_every_engine_matched(
        tiny_model_path: Path, backend: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    async with TorchEngine(model, None) as engine:
        report, committed = await _push(engine, _perturbed(model, seed=3), dtype=torch.bfloat16, backend=backend)
    assert isinstance(report, TransferReport) and committed == 7
    assert report.fingerprints == FingerprintCheck("xxh3", matched=("rollout-0",))
    assert set(report.fingerprints.seconds) == {"sender", "rollout-0"}  # what the check cost each end
    assert all(seconds > 0 for seconds in report.fingerprints.seconds.values())


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["gloo", "shm"])
async def test_a_tensor_altered_after_its_load_fails_the_push_naming_engine_and_tensor(
        tiny_model_path: Path, backend: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    target = "model.layers.0.mlp.down_proj.weight"
    async with TorchEngine(model, None) as engine:
        _after_load(engine, lambda: model.get_parameter(target).data[0, 0].add_(1e-3))
        outcome, committed = await _push(engine, _perturbed(model, seed=4), backend=backend)
    assert isinstance(outcome, WeightsDiffer) and committed is None
    assert outcome.check.differ == {"rollout-0": [target]}
    assert outcome.failed == {"rollout-0": f"serves other bits in {target}"}


@pytest.mark.integration
async def test_generation_goes_on_while_the_engine_fingerprints_a_push(tiny_model_path: Path) -> None:
    """The check costs generation no pause: once the weights are in, a request completes while the engine's
    fingerprint of them is still under way, and the push then commits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    async with TorchEngine(model, None) as engine:
        fingerprinting, release = threading.Event(), threading.Event()
        prints_of = engine._weights.fingerprints

        def held_prints(*args: object) -> ServedPrints:
            fingerprinting.set()
            assert release.wait(30)
            return prints_of(*args)  # type: ignore[arg-type]

        engine._weights.fingerprints = held_prints  # type: ignore[method-assign]
        pushing = asyncio.create_task(_push(engine, _perturbed(model, seed=10)))
        assert await asyncio.to_thread(fingerprinting.wait, 30)
        greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        [output] = await asyncio.wait_for(engine.generate(GenerateRequest("during", [1, 2, 3], greedy)), 30)
        assert len(output.output_ids) == 4 and output.versions == [7] * 4  # the pushed weights
        release.set()
        report, committed = await asyncio.wait_for(pushing, 30)
    assert isinstance(report, TransferReport) and committed == 7


@pytest.mark.integration
async def test_a_strided_check_catches_a_tensor_the_load_skipped_and_commits_an_honest_push(
        tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    skipped = "model.layers.1.self_attn.o_proj.weight"
    async with TorchEngine(model, None) as engine:
        report, _ = await _push(engine, _perturbed(model, seed=8), stride=16)
        assert isinstance(report, TransferReport) and report.fingerprints is not None
        assert report.fingerprints.matched == ("rollout-0",)
        before = model.get_parameter(skipped).detach().clone()
        _after_load(engine, lambda: model.get_parameter(skipped).data.copy_(before))  # as if never loaded
        outcome, _ = await _push(engine, _perturbed(model, seed=9), version=8, stride=16)
    assert isinstance(outcome, WeightsDiffer) and outcome.check.differ == {"rollout-0": [skipped]}


@pytest.mark.integration
async def test_an_engine_that_rounded_what_it_received_is_reported_unchecked_not_wrong(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    async with TorchEngine(model, None) as engine:
        report, committed = await _push(engine, _perturbed(model, seed=5, dtype=torch.float32))
    assert isinstance(report, TransferReport) and committed == 7 and report.fingerprints is not None
    assert report.fingerprints.matched == () and "sent as torch.float32" in report.fingerprints.unchecked["rollout-0"]


class _PluginEngine(TorchEngine):
    """An engine written without fingerprints, as a plugin engine may be: the base class's answer."""

    async def served_fingerprints(self, specs: tuple[TensorSpec, ...], plan: FingerprintPlan) -> ServedPrints | None:
        return None


@pytest.mark.integration
async def test_an_engine_that_cannot_fingerprint_is_named_as_unchecked(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    async with _PluginEngine(model, None) as engine:
        report, committed = await _push(engine, _perturbed(model, seed=6))
    assert isinstance(report, TransferReport) and committed == 7 and report.fingerprints is not None
    assert report.fingerprints.unchecked == {"rollout-0": "its engine cannot fingerprint the weights it serves"}


def _adapter(model: torch.nn.Module, seed: int, rank: int = 4) -> list[tuple[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    factors = []
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        out_features, in_features = model.get_parameter(f"{module}.weight").shape
        factors += [(f"{module}.lora_A.weight", torch.randn(rank, in_features, generator=generator) * 0.1),
                    (f"{module}.lora_B.weight", torch.randn(out_features, rank, generator=generator) * 0.1)]
    return factors


@pytest.mark.integration
async def test_an_adapter_merged_as_sent_commits(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    async with TorchEngine(model, None, lora_scaling=2.0) as engine:
        report, committed = await _push(engine, _adapter(model, seed=7))
    assert isinstance(report, TransferReport) and committed == 7
    assert report.fingerprints is not None and report.fingerprints.matched == ("rollout-0",)


@pytest.mark.integration
async def test_an_adapter_received_but_never_merged_fails_the_push_naming_its_factors(
        tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    merge = AdapterMerger._merge

    def merge_all_but_up_proj(merger: AdapterMerger, module: str) -> None:
        if module.endswith("up_proj"):
            merger._bases.setdefault(module, merger._parameters[f"{module}.weight"].detach().clone())
            return  # the bug: the factors are stored, the layer keeps its old weight
        merge(merger, module)

    monkeypatch.setattr(AdapterMerger, "_merge", merge_all_but_up_proj)
    async with TorchEngine(model, None, lora_scaling=2.0) as engine:
        outcome, committed = await _push(engine, _adapter(model, seed=8))
    assert isinstance(outcome, WeightsDiffer) and committed is None
    assert outcome.check.differ == {"rollout-0": ["model.layers.0.mlp.up_proj.lora_A.weight",
                                                  "model.layers.0.mlp.up_proj.lora_B.weight"]}


@pytest.mark.integration
async def test_a_strided_check_catches_an_adapter_never_merged_at_every_push_in_the_layers_it_checks(
        tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stride 2: each push checks the merge of one of the two adapted layers (in name order, the one at the version
    modulo 2); an adapter never merged anywhere fails every push, naming the layer that push checked."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)

    def store_only(merger: AdapterMerger, module: str) -> None:  # the bug: factors stored, no layer merged
        merger._bases.setdefault(module, merger._parameters[f"{module}.weight"].detach().clone())

    monkeypatch.setattr(AdapterMerger, "_merge", store_only)
    differ = {}
    async with TorchEngine(model, None, lora_scaling=2.0) as engine:
        for version in (7, 8):
            outcome, _ = await _push(engine, _adapter(model, seed=version), version=version, stride=2)
            assert isinstance(outcome, WeightsDiffer)
            differ[version] = outcome.check.differ["rollout-0"]
    factors = {module: [f"model.layers.0.{module}.lora_{factor}.weight" for factor in "AB"]
               for module in ("self_attn.q_proj", "mlp.up_proj")}
    assert differ == {7: factors["self_attn.q_proj"], 8: factors["mlp.up_proj"]}
