"""A push streams its tensors against recorded specs: a source that makes its tensors as it goes (Megatron's
gathered shards) is held a bucket at a time, not whole; a source that breaks mid-way fails the transfer cleanly,
names no engine, frees the receivers at once, and the next generation commits."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from engines.weights import GroupSpec, TorchDistributedWeightReceiver, TorchDistributedWeightSender
from engines.weights import group as groups
from engines.weights.base import WeightTransferError
from engines.weights.manifest import TensorSpec
from engines.weights.stream import SourceBroke, SpecifiedTensors, record_specs, specified, wire_specs
from tests.engines.test_weights_transfer import digest
from tests.support.gathering import Gathering

TIMEOUT_S = 60.0
LAYERS = 12


def _model(version: int) -> list[tuple[str, Tensor]]:
    """Twelve 64 KiB matrices (each travels alone at the test's direct size) and their small biases."""
    generator = torch.Generator().manual_seed(version)
    tensors = []
    for layer in range(LAYERS):
        tensors.append((f"layers.{layer}.weight", torch.randn(128, 128, generator=generator)))
        tensors.append((f"layers.{layer}.bias", torch.randn(128, generator=generator)))
    return tensors


@pytest.mark.unit
def test_a_stream_that_matches_its_specs_passes_through() -> None:
    model = _model(1)
    specs = record_specs(iter(model))
    assert [spec.name for spec in specs] == [name for name, _ in model]
    streamed = list(SpecifiedTensors(specs, iter(model)))
    assert [(name, tensor.data_ptr()) for name, tensor in streamed] == [(n, t.data_ptr()) for n, t in model]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m[:5], "ended before tensor 6 of 24 ('layers.2.bias')"),
        (lambda m: [*m, ("extra.weight", torch.zeros(2))], "'extra.weight' is new"),
        (lambda m: [(n, t[:64] if i == 3 else t) for i, (n, t) in enumerate(m)], "tensor 4 of 24 ('layers.1.bias')"),
        (lambda m: [(n, t.half() if i == 0 else t) for i, (n, t) in enumerate(m)], "torch.float16"),
        (lambda m: [("renamed" if i == 1 else n, t) for i, (n, t) in enumerate(m)], "yields 'renamed'"),
    ],
    ids=["short", "long", "shape", "dtype", "name"],
)
def test_a_stream_that_differs_from_its_specs_breaks_with_the_tensor_named(change: Any, message: str) -> None:
    specs = record_specs(iter(_model(1)))
    with pytest.raises(SourceBroke, match=message.replace("(", r"\(").replace(")", r"\)")):
        list(SpecifiedTensors(specs, iter(change(_model(1)))))


@pytest.mark.unit
def test_a_source_that_raises_breaks_the_stream_and_is_closed() -> None:
    source = Gathering(_model(1), fail_at=3)
    generator = iter(source)
    stream = SpecifiedTensors(record_specs(iter(_model(1))), generator)
    with pytest.raises(SourceBroke, match=r"failed at tensor 4 of 24 \('layers.1.bias'\).*all-gather"):
        list(stream)
    stream.close()
    assert generator.gi_frame is None


@pytest.mark.unit
def test_specs_are_recorded_without_keeping_a_tensor_and_cast_only_floats_on_the_wire() -> None:
    source = Gathering([*_model(1), ("step", torch.tensor([3], dtype=torch.int64))])
    specs = record_specs(iter(source))
    assert source.peak == 1 and source.alive == 0
    wire = wire_specs(specs, torch.bfloat16)
    assert wire[0] == TensorSpec("layers.0.weight", torch.bfloat16, (128, 128))
    assert wire[-1] == TensorSpec("step", torch.int64, (1,))
    with pytest.raises(ValueError, match="'a' appears twice"):
        record_specs(iter([("a", torch.zeros(1)), ("a", torch.zeros(1))]))
    with pytest.raises(ValueError, match="'a' appears twice"):
        specified([("a", torch.zeros(1)), ("a", torch.zeros(1))])


def _receiver_main(spec: dict[str, Any], name: str, next_specs: mp.Queue, events: mp.Queue) -> None:
    """An engine that reports each transfer (version and digests, or the error and how long it took to say so),
    and joins the next generation it is handed after a failure."""
    torch.set_num_threads(1)
    live: dict[str, Tensor] = {}

    def load(items: Any) -> None:
        for key, tensor in items:
            live[key] = tensor.clone()

    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=TIMEOUT_S)
    while True:
        started = time.monotonic()
        try:
            version = receiver.receive(load, timeout=TIMEOUT_S)
        except TimeoutError:
            break
        except WeightTransferError as error:
            events.put(("failed", str(error), time.monotonic() - started))
            new_spec = next_specs.get(timeout=TIMEOUT_S)
            if new_spec is None:
                break
            receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(new_spec), name, timeout_s=TIMEOUT_S)
            continue
        events.put(("ok", version, {key: digest(tensor) for key, tensor in live.items()}))
    receiver.close()


@pytest.fixture
def engine() -> Iterator[tuple[TorchDistributedWeightSender, mp.Queue, mp.Queue]]:
    context = mp.get_context("spawn")
    # Tensors of 64 KiB and more travel alone, from their own memory; the biases share 4 KiB buckets.
    sender = TorchDistributedWeightSender(timeout_s=TIMEOUT_S, backend="gloo", bucket_bytes=4096, direct_bytes=65536)
    next_specs, events = context.Queue(), context.Queue()
    spec = sender.open_group(["learner", "engine-0"])
    process = context.Process(target=_receiver_main, args=(spec.to_dict(), "engine-0", next_specs, events),
                              daemon=True)
    process.start()
    sender.wait_for_receivers()
    try:
        yield sender, next_specs, events
    finally:
        next_specs.put(None)
        sender.close()
        process.join(timeout=TIMEOUT_S)
        if process.is_alive():
            process.kill()


@pytest.mark.integration
def test_a_gathering_source_is_held_a_bucket_at_a_time_not_whole(
    engine: tuple[TorchDistributedWeightSender, mp.Queue, mp.Queue],
) -> None:
    """Listed whole, every gathered tensor stays alive until the transfer ends (24 here, the model); streamed
    against recorded specs, only the broadcasts in flight and the one being pulled."""
    sender, _, events = engine
    model = _model(1)
    expected = {name: digest(tensor) for name, tensor in model}

    listed = Gathering(model)
    sender.send(iter(listed), version=1)
    assert events.get(timeout=TIMEOUT_S) == ("ok", 1, expected)

    streamed = Gathering(model)
    report = sender.send(SpecifiedTensors(record_specs(iter(model)), iter(streamed)), version=2)
    assert events.get(timeout=TIMEOUT_S) == ("ok", 2, expected)
    assert report.num_tensors == len(model) and sender.committed_version == 2
    assert listed.peak == len(model)
    # The broadcasts in flight, the one being pulled, and at most one whose broadcast completed but whose tensor
    # gloo's worker thread has not let go of yet (a loaded CI machine showed 4 once): a few, never the model.
    assert streamed.peak <= groups.IN_FLIGHT + 2, f"{streamed.peak} gathered tensors alive at once"
    assert streamed.released_within(5.0), f"{streamed.alive} gathered tensor(s) outlived the transfer by 5 s"


@pytest.mark.integration
def test_a_source_that_breaks_mid_way_fails_the_transfer_frees_the_engine_and_the_next_generation_commits(
    engine: tuple[TorchDistributedWeightSender, mp.Queue, mp.Queue],
) -> None:
    sender, next_specs, events = engine
    specs = record_specs(iter(_model(1)))
    assert sender.send(SpecifiedTensors(specs, iter(_model(1))), version=1).version == 1
    assert events.get(timeout=TIMEOUT_S)[:2] == ("ok", 1)

    broke = r"broke mid-way.*tensor 15 of 24 \('layers.7.weight'\).*all-gather"
    with pytest.raises(WeightTransferError, match=broke) as error:
        sender.send(SpecifiedTensors(specs, iter(Gathering(_model(2), fail_at=14))), version=2)
    assert error.value.failed == {}, "the learner's own tensors broke: no engine is to blame"
    assert sender.committed_version == 1
    outcome, message, seconds = events.get(timeout=TIMEOUT_S)
    assert outcome == "failed" and "the learner's tensors broke mid-way" in message, message
    assert seconds < 10, f"the engine waited {seconds:.1f}s for buckets that were never coming"
    with pytest.raises(WeightTransferError, match="not usable"):
        sender.send(SpecifiedTensors(specs, iter(_model(2))), version=2)

    next_specs.put(sender.open_group(["learner", "engine-0"]).to_dict())
    sender.wait_for_receivers()
    sender.send(SpecifiedTensors(specs, iter(Gathering(_model(3)))), version=3)
    assert events.get(timeout=TIMEOUT_S) == ("ok", 3, {name: digest(tensor) for name, tensor in _model(3)})
    assert sender.committed_version == 3
