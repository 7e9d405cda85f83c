"""Process groups and devices for the Megatron trainer: use the caller's world if there is one, else make a world
of one; put every tensor a collective sees on the device its backend can carry.

The learner actor runs one process today and several later; the trainer must work in both without the caller
knowing about megatron. Megatron's own groups (TP, PP, DP, embedding, and the gloo DP groups its distributed
optimizer uses for CPU objects) are carved out of the default group.

Backend. With CUDA the default group must be NCCL: mbridge scatters CUDA weight shards at load, the distributed
optimizer reduce-scatters CUDA gradient buffers, and gloo's CUDA collectives are host-staged (slow) or missing
depending on the torch version. Without CUDA it is gloo. Pickled-object collectives (`all_gather_object`,
`broadcast_object_list`) work on both: torch stages them on `torch.cuda.current_device()` under NCCL, which is
why each rank must have selected its own GPU before the world forms.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def compute_device() -> torch.device:
    """Where megatron puts the model: the current CUDA device when there is one (megatron allocates with
    `torch.cuda.current_device()`), else the CPU (the `cpu_compat` path)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


MIXED_BACKEND = "cpu:gloo,cuda:nccl"


def backend_for_device(device: torch.device | str) -> str:
    """The default-group backend for a model on `device`: NCCL for CUDA tensors with gloo beside it for CPU ones
    (mbridge scatters the CPU tensors it reads from safetensors through the default group), gloo for the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return MIXED_BACKEND
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"the Megatron trainer runs on 'cuda' or 'cpu' devices, not {kind!r}")


def backend_devices(backend: str) -> list[str] | None:
    """The device types a backend carries; a mixed one ("cpu:gloo,cuda:nccl") carries each device it names."""
    if ":" in backend:
        return [part.split(":", 1)[0].strip().lower() for part in backend.split(",")]
    return dist.Backend.backend_capability.get(backend.lower())


def collective_device(backend: str, compute: torch.device | str) -> torch.device:
    """The device of the tensors handed to a collective on a `backend` group, for a model on `compute`.

    A backend that carries CPU tensors (gloo) gets CPU tensors: our collectives move flags and log-prob vectors,
    and gloo's CUDA path is host-staged anyway. A CUDA-only backend (NCCL) gets tensors on the model's GPU: it
    has no CPU path at all, so a CPU tensor there fails at the first collective.
    """
    compute = torch.device(compute)
    devices = backend_devices(backend)
    if devices is None:
        raise ValueError(f"unknown torch.distributed backend {backend!r}")
    if "cpu" in devices:
        return torch.device("cpu")
    if compute.type not in devices:
        raise ValueError(f"backend {backend!r} carries {devices} tensors, but the model is on {compute}")
    return compute


def world_collective_device() -> torch.device:
    """`collective_device` for the default group of this process."""
    return collective_device(dist.get_backend(), compute_device())


def ensure_default_group(device: torch.device | None = None) -> bool:
    """Initialise a world-size-1 group for `device` (NCCL on CUDA, gloo on CPU) unless a world exists; return
    whether this call created it. An existing world must use the backend `device` needs (see module docstring).
    """
    device = compute_device() if device is None else torch.device(device)
    backend = backend_for_device(device)
    if dist.is_initialized():
        check_world_backend(dist.get_backend(), device)
        return False
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    return True


def check_world_backend(backend: str, device: torch.device) -> None:
    """Refuse a default group that cannot carry this model's CUDA collectives (a gloo-only world with CUDA)."""
    expected = backend_for_device(device)
    kind = torch.device(device).type
    carried = backend_devices(backend) or []
    # gloo moves CUDA tensors only through host copies: a CUDA model needs NCCL (or another CUDA backend) for them.
    cuda_backend = next((part.split(":")[-1] for part in backend.lower().split(",") if "cuda" in part or
                         ":" not in part), backend.lower())
    if kind not in carried or (kind == "cuda" and cuda_backend == "gloo"):
        raise ValueError(
            f"the Megatron trainer on {device} needs a default process group that carries {device.type} tensors "
            f"({expected!r}), got {backend!r}"
        )


def initialize_model_parallel(tensor_parallel: int, pipeline_parallel: int, seed: int, *, expert_parallel: int = 1,
                              expert_tensor_parallel: int | None = None) -> None:
    """Create megatron's groups for this layout (or check the existing ones match) and seed its RNG streams.

    Expert parallelism is carved out of the data-parallel ranks (megatron's layout): EP must divide the world over
    TP x PP, and the expert layout (expert TP x EP) must divide the world over PP. `expert_tensor_parallel` None is
    megatron's default, the attention's TP."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as megatron_tp

    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"world size {world} is not a multiple of tensor_model_parallel_size x pipeline_model_parallel_size = "
            f"{tensor_parallel} x {pipeline_parallel}"
        )
    expert_tp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    if (world // pipeline_parallel) % (expert_tp * expert_parallel):
        raise ValueError(
            f"world size {world} over pipeline_model_parallel_size {pipeline_parallel} is not a multiple of "
            f"expert_tensor_parallel_size x expert_model_parallel_size = {expert_tp} x {expert_parallel}"
        )
    wanted = (tensor_parallel, pipeline_parallel, expert_parallel, expert_tp)
    if parallel_state.model_parallel_is_initialized():
        existing = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
        if existing != wanted:
            raise ValueError(
                f"megatron is already initialised with (TP, PP, EP, expert TP) = {existing}, not {wanted}; one "
                "process hosts one parallel layout"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
            expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=expert_tp,
        )
    torch.manual_seed(seed)
    megatron_tp.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def ep_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def dp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()
