"""The weight-transfer mechanisms by name: each pairs a learner-side sender with an engine-side loader.

The learner picks a mechanism once, by name, and every group spec its sender hands out carries that name under
`"transport"`; a rollout worker resolves the same name here to build the matching loader. So neither side
branches on a mechanism: adding one (a plugin named `package.module:attr`, resolving to a `WeightTransport`)
touches neither the learner nor the rollout worker.

Nothing here imports torch or a mechanism at module level: a rollout worker that never loads a torch mechanism
(an SGLang server receives the bytes itself) must not pay for importing torch. The built-in factories import
their mechanism when first called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engines.weights.names import DISK, SGLANG, SGLANG_DISK, SGLANG_LORA, SGLANG_TENSOR, TORCH_DISTRIBUTED
from policies.plugins import load_object

if TYPE_CHECKING:
    from engines.weights.base import WeightSender

__all__ = ["DISK", "SGLANG", "SGLANG_DISK", "SGLANG_LORA", "SGLANG_TENSOR", "TORCH_DISTRIBUTED", "EngineLoader",
           "SenderOptions", "WeightTransport", "resolve_transport"]


@dataclass(frozen=True)
class SenderOptions:
    """What any sender needs, filled once by the learner from the run's configuration."""

    host: str  # the address engines reach the learner's rendezvous store at
    backend: str  # "gloo" | "nccl" | "cuda_ipc" (ignored by mechanisms that need none)
    timeout_s: float  # how long a transfer waits for an engine before naming it as failed
    gpus_per_engine: int = 1  # ranks each engine occupies in the group (SGLang's tensor-parallel servers)
    fingerprint_stride: int = 1  # a checked push fingerprints 1/stride of the rows (`engines.weights.fingerprint`)
    delta_sync: bool = False  # pushes after the first send what changed (`engines.weights.held`), where supported
    delta_anchor: int = 20  # ... and a full one every this many versions
    delta_backoff: int = 8  # ... and this many full ones after a delta that was slower than a full push
    bucket_bytes: int | None = None  # the most bytes one transfer coalesces (None: the mechanism's default)
    disk: DiskOptions | None = None  # the disk mechanisms' folder and hook (`engines.weights.disk_files`)


@dataclass(frozen=True)
class DiskOptions:
    """Where the disk mechanisms write each push, and what happens around it (slime's `--update-weight-disk-*`)."""

    directory: str  # seen by the learner and every engine under this path
    keep_files: bool = False  # leave each version's folder in place after its push
    local_directory: str | None = None  # each engine copies a push here (its own disk) and reads it from there
    post_write: Callable[[str, tuple[str, ...]], None] | None = None  # (version folder, engines), before they read


class EngineLoader(Protocol):
    """The engine side of one mechanism, one per rollout worker and sender; `group` is the sender's spec as a dict.

    A mechanism whose transport says `named_adapters` also takes `adapter=name` (the weights are that named adapter's,
    loaded beside the others: a run of several policies); the others are never passed one."""

    async def apply(self, group: Mapping[str, Any], version: int, timeout_s: float) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class WeightTransport:
    name: str
    make_sender: Callable[[SenderOptions], WeightSender]  # learner rank 0, built once
    make_loader: Callable[[Any, str, Any], EngineLoader]  # (engine, actor_id, log) on each rollout worker
    # The engines load tensors under the checkpoint's names (SGLang's `load_weights`), not transformers' in-memory
    # ones: a mixture-of-experts layer goes out one tensor per expert (`engines.weights.layouts`).
    checkpoint_names: bool = False
    # Its loader takes `adapter=`: an update of one named adapter of an engine (a policy's, in a run of several).
    named_adapters: bool = False
    # Its sender honours `SenderOptions.delta_sync`: after a full push, only what changed travels.
    delta_sync: bool = False
    # ... into a checkpoint each engine host keeps in `DiskOptions.local_directory`, which delta sync then needs.
    delta_needs_local_directory: bool = False


def is_plugin(name: str) -> bool:
    """A `module:attr` path names a user's transport; built-in names have no colon."""
    return ":" in name


def resolve_transport(name: str) -> WeightTransport:
    """The built-in mechanism called `name`, or the `WeightTransport` a `module:attr` path names.

    A plugin comes back named by its path, whatever name it gave itself, because that path is what engines
    receive in the group spec and resolve again on their side.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    if not is_plugin(name):
        raise ValueError(f"weight transport {name!r}: unknown; built-ins are {sorted(BUILTIN)}, or 'module:attr'")
    found = load_object(name, what="weight transport")
    if not isinstance(found, WeightTransport):
        raise TypeError(
            f"weight transport {name!r}: expected an engines.weights.transport.WeightTransport, "
            f"got {type(found).__name__}"
        )
    return found if found.name == name else dataclasses.replace(found, name=name)


# ---- built-ins: each imports its mechanism only when used ------------------------------------------------------


def _bucket(options: SenderOptions) -> dict[str, int]:
    """The bucket size asked for, else nothing: each mechanism keeps its own default (sized for its wire)."""
    return {} if options.bucket_bytes is None else {"bucket_bytes": options.bucket_bytes}


def _torch_distributed_sender(options: SenderOptions) -> WeightSender:
    from engines.weights.torch_distributed import TorchDistributedWeightSender

    return TorchDistributedWeightSender(
        host=options.host,
        backend=options.backend,  # type: ignore[arg-type]  # GroupSpec validates it
        timeout_s=options.timeout_s,
        fingerprint_stride=options.fingerprint_stride,
        delta_sync=options.delta_sync,
        anchor_every=options.delta_anchor,
        delta_backoff=options.delta_backoff,
        **_bucket(options),
    )


def _torch_distributed_loader(engine: Any, actor_id: str, log: Any) -> EngineLoader:
    from engines.weights.torch_loader import TorchDistributedLoader

    return TorchDistributedLoader(engine, actor_id, log)


def _sglang_sender(options: SenderOptions) -> WeightSender:
    from engines.sglang.weights import SglangWeightSender

    return SglangWeightSender(
        host=options.host,
        backend=options.backend,
        gpus_per_engine=options.gpus_per_engine,
        timeout_s=options.timeout_s,
        **_bucket(options),
    )


def _sglang_loader(engine: Any, actor_id: str, log: Any) -> EngineLoader:
    from engines.sglang.weights import SglangWeightLoader

    return SglangWeightLoader(engine, actor_id, log=log)


def _sglang_lora_sender(options: SenderOptions) -> WeightSender:
    from engines.weights.torch_distributed import TorchDistributedWeightSender

    # gloo whatever the machine: the receivers are rollout workers, whose GPUs belong to their SGLang servers, and
    # an adapter is small enough that its bytes cost little over TCP.
    return TorchDistributedWeightSender(
        host=options.host, backend="gloo", timeout_s=options.timeout_s, transport=SGLANG_LORA, **_bucket(options)
    )


def _sglang_lora_loader(engine: Any, actor_id: str, log: Any) -> EngineLoader:
    from engines.sglang.adapter_sync import SglangAdapterLoader

    return SglangAdapterLoader(engine, actor_id, log)


def _sglang_tensor_sender(options: SenderOptions) -> WeightSender:
    from engines.sglang.tensor_weights import SglangTensorSender

    return SglangTensorSender(host=options.host, gpus_per_engine=options.gpus_per_engine, timeout_s=options.timeout_s,
                              **_bucket(options))


def _sglang_tensor_loader(engine: Any, actor_id: str, log: Any) -> EngineLoader:
    from engines.sglang.tensor_weights import SglangTensorLoader

    return SglangTensorLoader(engine, actor_id, log=log)


def _disk(options: SenderOptions) -> dict[str, Any]:
    if options.disk is None:
        raise ValueError("a disk weight transport needs a folder (--weight-disk-dir)")
    return {"directory": options.disk.directory, "keep_files": options.disk.keep_files,
            "local_directory": options.disk.local_directory, "post_write": options.disk.post_write}


def _disk_sender(options: SenderOptions) -> WeightSender:
    from engines.weights.disk import DiskWeightSender

    return DiskWeightSender(host=options.host, timeout_s=options.timeout_s,
                            fingerprint_stride=options.fingerprint_stride, delta_sync=options.delta_sync,
                            anchor_every=options.delta_anchor, delta_backoff=options.delta_backoff,
                            **_bucket(options), **_disk(options))


def _disk_loader(engine: Any, actor_id: str, log: Any) -> EngineLoader:
    from engines.weights.disk import DiskWeightReceiver
    from engines.weights.torch_loader import TorchDistributedLoader

    return TorchDistributedLoader(engine, actor_id, log, receiver_class=DiskWeightReceiver)


def _sglang_disk_sender(options: SenderOptions) -> WeightSender:
    from engines.sglang.disk_weights import SglangDiskSender

    return SglangDiskSender(host=options.host, gpus_per_engine=options.gpus_per_engine, timeout_s=options.timeout_s,
                            delta_sync=options.delta_sync, anchor_every=options.delta_anchor,
                            delta_backoff=options.delta_backoff, **_bucket(options), **_disk(options))


def _sglang_disk_loader(engine: Any, actor_id: str, log: Any) -> EngineLoader:
    from engines.sglang.disk_weights import SglangDiskLoader

    return SglangDiskLoader(engine, actor_id, log=log)


BUILTIN: dict[str, WeightTransport] = {
    TORCH_DISTRIBUTED: WeightTransport(TORCH_DISTRIBUTED, _torch_distributed_sender, _torch_distributed_loader,
                                       named_adapters=True, delta_sync=True),
    SGLANG: WeightTransport(SGLANG, _sglang_sender, _sglang_loader, checkpoint_names=True),
    # each policy's adapter loaded by name beside the others' (a run of several policies)
    SGLANG_LORA: WeightTransport(SGLANG_LORA, _sglang_lora_sender, _sglang_lora_loader, named_adapters=True),
    # colocated servers (--colocate): each bucket by reference to the learner's memory
    SGLANG_TENSOR: WeightTransport(SGLANG_TENSOR, _sglang_tensor_sender, _sglang_tensor_loader, checkpoint_names=True),
    # through a folder both sides see (--weight-transport disk): torch engines, deltas included, and SGLang servers,
    # each version a checkpoint their /update_weights_from_disk reads (a delta: patched into each host's local copy)
    DISK: WeightTransport(DISK, _disk_sender, _disk_loader, named_adapters=True, delta_sync=True),
    SGLANG_DISK: WeightTransport(SGLANG_DISK, _sglang_disk_sender, _sglang_disk_loader, checkpoint_names=True,
                                 delta_sync=True, delta_needs_local_directory=True),
}
