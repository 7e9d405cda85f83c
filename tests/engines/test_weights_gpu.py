"""The CUDA paths of weight transfer: NCCL between two GPUs, gloo with CUDA tensors and CUDA IPC on one."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from typing import Any

import pytest
import torch
from torch import Tensor

from engines.weights import GroupSpec, TorchDistributedWeightReceiver, TorchDistributedWeightSender

TIMEOUT_S = 120.0


def _weights(device: str) -> list[tuple[str, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    cpu = [
        ("embed.weight", torch.randn(512, 256, generator=generator)),
        ("layer.weight", torch.randn(256, 256, generator=generator)),
        ("layer.bias", torch.randn(256, generator=generator)),
        ("norm.weight", torch.randn(256, generator=generator)),
    ]
    return [(name, tensor.to(device)) for name, tensor in cpu]


def _digests(items: Any) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in items
    }


def _receiver_main(spec: dict[str, Any], device: str, results: mp.Queue) -> None:
    receiver = TorchDistributedWeightReceiver.join(
        GroupSpec.from_dict(spec), "engine-0", timeout_s=TIMEOUT_S, device=device
    )
    live = {name: torch.zeros_like(tensor) for name, tensor in _weights(device)}
    live_bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in live.items()}

    def load(items: Any) -> None:
        for name, tensor in items:
            (live if tensor.dtype == torch.float32 else live_bf16)[name].copy_(tensor)

    first = receiver.receive(load, timeout=TIMEOUT_S, destinations=live)
    second = receiver.receive(load, timeout=TIMEOUT_S)
    results.put((first, _digests(live.items()), second, _digests(live_bf16.items())))


def _run(backend: str, sender_device: str, receiver_device: str) -> None:
    context = mp.get_context("spawn")
    sender = TorchDistributedWeightSender(
        backend=backend, device=sender_device, bucket_bytes=300_000, direct_bytes=200_000, timeout_s=TIMEOUT_S
    )
    spec = sender.open_group(["learner", "engine-0"])
    results = context.Queue()
    process = context.Process(target=_receiver_main, args=(spec.to_dict(), receiver_device, results), daemon=True)
    process.start()
    try:
        sender.wait_for_receivers()
        weights = _weights(sender_device)
        sender.send(weights, version=1)
        sender.send(weights, version=2, dtype=torch.bfloat16)
        first, fp32, second, bf16 = results.get(timeout=TIMEOUT_S)
        assert (first, second) == (1, 2)
        assert fp32 == _digests(weights)
        assert bf16 == _digests((name, t.to(torch.bfloat16)) for name, t in weights)
        assert sender.committed_version == 2
    finally:
        process.join(timeout=TIMEOUT_S)
        sender.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one per rank)")
def test_nccl_transfer_between_two_gpus_is_bit_identical() -> None:
    _run("nccl", "cuda:0", "cuda:1")


@pytest.mark.gpu
def test_gloo_transfer_of_cuda_tensors_is_bit_identical() -> None:
    _run("gloo", "cuda:0", "cuda:0")


@pytest.mark.gpu
def test_cuda_ipc_transfer_on_one_gpu_is_bit_identical() -> None:
    """The one-GPU machine's path: learner and engine share the device, which NCCL refuses."""
    _run("cuda_ipc", "cuda:0", "cuda:0")


def _dying_receiver_main(spec: dict[str, Any]) -> None:
    """Takes version 1, then dies on the first bucket of version 2, leaving the rest of its broadcasts pending."""
    import os

    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), "engine-0", timeout_s=5.0,
                                                   device="cuda:1")
    live = {name: torch.zeros_like(tensor) for name, tensor in _weights("cuda:1")}

    def load(items: Any) -> None:
        for name, tensor in items:
            live[name].copy_(tensor)

    receiver.receive(load, timeout=60.0, destinations=live)
    receiver.receive(lambda items: os._exit(1), timeout=60.0)


def _sender_outliving_a_dead_receiver(results: mp.Queue) -> None:
    from engines.weights import WeightTransferError
    from engines.weights.group import collective_timeout_s

    context = mp.get_context("spawn")
    sender = TorchDistributedWeightSender(backend="nccl", device="cuda:0", bucket_bytes=100_000, direct_bytes=90_000,
                                          timeout_s=5.0)
    spec = sender.open_group(["learner", "engine-0"])
    receiver = context.Process(target=_dying_receiver_main, args=(spec.to_dict(),), daemon=True)
    receiver.start()
    sender.wait_for_receivers()
    weights = _weights("cuda:0")
    sender.send(weights, version=1)
    try:
        sender.send(weights, version=2)
        outcome = "version 2 committed without its receiver"
    except WeightTransferError as error:
        outcome = f"failed: {error}"
    time.sleep(collective_timeout_s(5.0) + 10)  # past the group's own timeout: the watchdog had its chance
    torch.cuda.synchronize()
    results.put(outcome)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one per rank)")
def test_a_receiver_dying_mid_transfer_on_nccl_fails_the_push_and_the_sender_lives_on() -> None:
    """NCCL queues the buckets without waiting: those the dead receiver never took stay pending on the sender's GPU,
    and NCCL's watchdog ends the process at the group's timeout unless the group is aborted first. The learner
    must see a failed push, and live."""
    context = mp.get_context("spawn")
    results = context.Queue()
    sender = context.Process(target=_sender_outliving_a_dead_receiver, args=(results,))
    sender.start()
    sender.join(timeout=240)
    assert sender.exitcode == 0, f"the sender process ended with {sender.exitcode}: the NCCL watchdog took it"
    outcome = results.get(timeout=5)
    assert outcome.startswith("failed:") and "engine-0" in outcome, outcome
