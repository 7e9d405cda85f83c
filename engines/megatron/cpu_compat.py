"""Run megatron-core on a CPU-only torch, for tests and CPU development; never on a machine with CUDA.

megatron-core assumes CUDA throughout: tensors are created with `device="cuda"` or
`torch.cuda.current_device()`, modules are moved with `.cuda()`, the DDP buffers open CUDA streams, the
optimizer checks `param.type() == "torch.cuda.FloatTensor"`, and the RNG tracker saves and restores CUDA
generator states. None of that has a meaning without a GPU, but all of it has an obvious CPU counterpart, and
the arithmetic megatron does (tensor-parallel layers, vocab-parallel reductions, pipeline send/recv, the
distributed optimizer's reduce-scatter/all-gather, dist checkpointing) runs unchanged on gloo. This module
supplies those counterparts:

- a `TorchFunctionMode` that rewrites every CUDA device argument (`"cuda"`, `"cuda:N"`, an int index,
  `torch.device("cuda")`) to the CPU, makes `Tensor.cuda()` / `pin_memory()` no-ops and reports CPU float
  tensors under their CUDA type names (the only spelling megatron's optimizer accepts);
- stand-ins for `torch.cuda.current_device`, `synchronize`, streams and events (all synchronous on a CPU);
- megatron's CUDA RNG tracker backed by the CPU generator, so `model_parallel_cuda_manual_seed` and
  `tracker.fork()` keep their meaning (per-TP-rank streams) on the one generator the CPU has;
- the device mode inside custom autograd Functions' backwards too, the MoE dispatcher's split sizes in the form
  torch's all-to-all takes (`_backward_stand_ins`, `_megatron_stand_ins`), and the all-gather and reduce-scatter
  of unequal sizes that expert tensor parallelism issues, which gloo lacks (`_UNEVEN_COLLECTIVES`).

Scope. `cpu_compat()` is entered explicitly, by the Megatron trainer, around each of its calls into megatron and
ONLY when `torch.cuda.is_available()` is false; it refuses to activate otherwise, so a GPU run can never take
this path by accident.
The patches are process-global while active (re-entrant, counted) and fully undone on the last exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
}
_CPU = torch.device("cpu")


def cuda_is_missing() -> bool:
    return not torch.cuda.is_available()


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True  # a bare index means a CUDA ordinal to torch
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


class _CpuDeviceMode(TorchFunctionMode):
    """Redirect CUDA devices to the CPU at every torch call made while active (see the module docstring)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to:
            args = (args[0], *(_CPU if _is_cuda_device(arg) else arg for arg in args[1:]))
        uneven = _UNEVEN_COLLECTIVES.get(func)
        if uneven is not None and _sizes_differ(args[0] if func is dist.all_gather else args[1]):
            return uneven(*args, **kwargs)
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return _CUDA_TYPE_NAMES.get(result, result)
        return result


def _sizes_differ(tensors: Any) -> bool:
    return isinstance(tensors, (list, tuple)) and len({tuple(t.shape) for t in tensors}) > 1


def _uneven_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                       async_op: bool = False) -> None:
    """gloo's all_gather takes equal sizes only; megatron's expert-TP dispatcher gathers rows of unequal counts
    (NCCL takes them): every rank sends its rows padded to the longest, then each slot keeps its own count."""
    longest = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    slots = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
    dist.all_gather(slots, padded, group=group)
    for target, slot in zip(tensor_list, slots, strict=True):
        target.copy_(slot[: target.shape[0]])


def _uneven_reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = None, group: Any = None,
                           async_op: bool = False) -> None:
    """The same for gloo's reduce_scatter: the sum of every rank's whole input, of which each keeps its part."""
    whole = torch.cat([t.reshape(t.shape[0], -1) for t in input_list]).contiguous()
    dist.all_reduce(whole, op=op or dist.ReduceOp.SUM, group=group)
    start = sum(t.shape[0] for t in input_list[: dist.get_rank(group)])
    output.copy_(whole[start : start + output.shape[0]].reshape(output.shape))


_UNEVEN_COLLECTIVES: dict[Any, Callable[..., None]] = {dist.all_gather: _uneven_all_gather,
                                                       dist.reduce_scatter: _uneven_reduce_scatter}


class _Stream:
    """A CUDA stream on a machine with one synchronous device: every wait is already satisfied."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _cuda_stand_ins() -> dict[str, Any]:
    default_stream = _Stream()
    return {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "Stream": _Stream,
        "Event": _Event,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "current_stream": lambda device=None: default_stream,
        "default_stream": lambda device=None: default_stream,
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
    }


def _backward_stand_ins() -> list[tuple[Any, str, Any]]:
    """The autograd engine runs a custom Function's backward without the caller's function modes, so megatron's
    collectives that allocate their output on `torch.cuda.current_device()` in a backward (the MoE all-to-all,
    the sequence-parallel gathers) would ask for a GPU: each such backward runs inside the device mode too."""
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.apply

    def apply(self: Any, *args: Any) -> Any:
        with _CpuDeviceMode():
            return original(self, *args)

    return [(BackwardCFunction, "apply", apply)]


def _megatron_stand_ins() -> list[tuple[Any, str, Any]]:
    """megatron's RNG tracker reads CUDA generators directly; give it the CPU one. Its MoE token dispatcher moves
    the all-to-all split sizes off the GPU as numpy arrays (the form `all_to_all_single` accepts) and leaves a
    tensor already on the CPU as it is, which torch then refuses: give it the numpy arrays here too."""
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import token_dispatcher

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    return [(megatron_random, "_get_cuda_rng_state", get_state), (megatron_random, "_set_cuda_rng_state", set_state),
            (token_dispatcher, "maybe_move_tensor_to_cpu", host_copy)]


class _SameGeneratorWarning(logging.Filter):
    """Drops megatron's "CPU RNG state changed within GPU RNG context": its tracker warns when the CPU generator
    moves inside a CUDA-generator fork, and here the forked generator IS the CPU one, so it always moves. Left in,
    it fills the console with a line per forked layer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_MEGATRON_RNG_LOGGER = "megatron.core.tensor_parallel.random"


class _Patches:
    """Process-wide patch set, applied on the first enter and undone on the last exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._rng_warning = _SameGeneratorWarning()

    def acquire(self) -> None:
        with self._lock:
            if self._depth == 0:
                targets = [(torch.cuda, name, value) for name, value in _cuda_stand_ins().items()]
                for owner, name, value in targets + _megatron_stand_ins() + _backward_stand_ins():
                    self._saved.append((owner, name, getattr(owner, name)))
                    setattr(owner, name, value)
                logging.getLogger(_MEGATRON_RNG_LOGGER).addFilter(self._rng_warning)
            self._depth += 1

    def release(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for owner, name, value in reversed(self._saved):
                    setattr(owner, name, value)
                self._saved.clear()
                logging.getLogger(_MEGATRON_RNG_LOGGER).removeFilter(self._rng_warning)


_PATCHES = _Patches()


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Make megatron-core's CUDA calls land on the CPU for the duration of the block (CPU-only torch only)."""
    if not cuda_is_missing():
        raise RuntimeError("cpu_compat() is for machines without CUDA; megatron runs natively here")
    _PATCHES.acquire()
    try:
        with _CpuDeviceMode():
            yield
    finally:
        _PATCHES.release()


def maybe_cpu_compat() -> contextlib.AbstractContextManager[None]:
    """`cpu_compat()` where CUDA is missing, nothing where it is present: how the trainer wraps its calls."""
    return cpu_compat() if cuda_is_missing() else contextlib.nullcontext()
