"""Weights arrive bit-identical at every receiver, over gloo and over shared memory: fp32, bf16 and fp32 cast to
bf16, several bucket layouts, staged or in place; and a receiver waiting for a transfer that never comes times
out cleanly."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from typing import Any

import pytest
import torch
from torch import Tensor

from engines.weights import GroupSpec, TorchDistributedWeightReceiver, TorchDistributedWeightSender, shared_memory

# (bucket_bytes, direct_bytes): buckets smaller than the largest tensor (10 KB); small buckets with large
# tensors alone; one bucket for everything.
LAYOUTS = [(1000, 10**9), (4096, 2048), (1 << 20, 1 << 20)]
# (dtype the sender holds its floating tensors in, dtype it is asked to send): fp32 as held, bf16 as held, and
# fp32 master weights cast to bf16 on the way (the trainer's case). None: unchanged.
VARIANTS = [(None, None), (torch.bfloat16, None), (None, torch.bfloat16)]
TIMEOUT_S = 60.0


def _model(version: int) -> list[tuple[str, Tensor]]:
    """Different values at every version, so stale weights at a receiver cannot pass for new ones."""
    generator = torch.Generator().manual_seed(version)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 40, generator=generator)),
        ("model.layers.0.input_layernorm.weight", torch.randn(40, generator=generator)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(40, 40, generator=generator)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(40, generator=generator)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(40, 24, generator=generator)),
        ("model.rotary.scale", torch.randn((), generator=generator)),
        ("model.step_counter", torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64) + version),
        ("lm_head.weight", torch.randn(64, 40, generator=generator)),
    ]


def _as(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def digest(tensor: Tensor) -> str:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype}:{tuple(tensor.shape)}:{hashlib.sha256(raw).hexdigest()}"


def _receiver_main(spec: dict[str, Any], name: str, transfers: int, results: mp.Queue) -> None:
    """An engine: odd transfers offer its live tensors as destinations, even ones load through load_fn."""
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=TIMEOUT_S)
    live: dict[str, Tensor] = {}

    def load(items: Any) -> None:
        for key, tensor in items:
            if key not in live or live[key].dtype != tensor.dtype or live[key].shape != tensor.shape:
                live[key] = torch.empty_like(tensor)
            live[key].copy_(tensor)

    for transfer in range(transfers):
        in_place = transfer % 2 == 1
        pointers = {key: tensor.data_ptr() for key, tensor in live.items()}
        version = receiver.receive(load, timeout=TIMEOUT_S, destinations=live if in_place else None)
        kept_storage = all(live[key].data_ptr() == pointer for key, pointer in pointers.items())
        results.put((name, version, in_place, kept_storage, {key: digest(t) for key, t in live.items()}))
    try:
        receiver.receive(load, timeout=0.3)
        results.put((name, "received a transfer that was never sent"))
    except TimeoutError as error:
        results.put((name, str(error)))
    receiver.close()


@pytest.mark.integration
@pytest.mark.parametrize("receivers", [1, 2])
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_weights_arrive_bit_identical_at_every_receiver(backend: str, receivers: int) -> None:
    context = mp.get_context("spawn")
    sender = TorchDistributedWeightSender(timeout_s=TIMEOUT_S, backend=backend)
    names = [f"engine-{index}" for index in range(receivers)]
    spec = sender.open_group(["learner", *names])
    results = context.Queue()
    transfers = len(VARIANTS) * len(LAYOUTS)
    processes = [
        context.Process(target=_receiver_main, args=(spec.to_dict(), name, transfers, results), daemon=True)
        for name in names
    ]
    for process in processes:
        process.start()
    try:
        sender.wait_for_receivers()
        version, previous_wire = 0, None
        for held, dtype in VARIANTS:
            for bucket_bytes, direct_bytes in LAYOUTS:
                version += 1
                model = [(name, _as(t, held)) for name, t in _model(version)]
                expected = {name: digest(_as(t, dtype)) for name, t in model}
                sender.bucket_bytes, sender.direct_bytes = bucket_bytes, direct_bytes
                report = sender.send(model, version, dtype=dtype)
                assert report.receivers == tuple(names)
                assert sender.committed_version == version
                arrived = [results.get(timeout=TIMEOUT_S) for _ in names]
                assert sorted(name for name, *_ in arrived) == names
                wire = dtype or held
                for name, got_version, in_place, kept_storage, digests in arrived:
                    assert got_version == version, name
                    assert digests == expected, (name, held, dtype, bucket_bytes, direct_bytes)
                    if in_place and wire == previous_wire:  # live tensors already had the wire dtype
                        assert kept_storage, f"{name}: destinations were replaced instead of written in place"
                previous_wire = wire
        idle = dict(results.get(timeout=TIMEOUT_S) for _ in names)
        assert idle == {name: f"{name}: no weight transfer started within 0.3s" for name in names}
        # Every receiver mapped the staging files, so their names are gone already: a learner killed now leaves
        # nothing in /dev/shm.
        assert not list(shared_memory._directory().glob(f"slipstream-weights-{os.getpid()}-*"))
    finally:
        for process in processes:
            process.join(timeout=TIMEOUT_S)
        sender.close()
    assert all(process.exitcode == 0 for process in processes)
    assert not list(shared_memory._directory().glob(f"slipstream-weights-{os.getpid()}-*"))
