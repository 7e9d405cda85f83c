"""Process groups for the Megatron trainer: use the caller's world if there is one, else make a world of one.

The learner actor runs one process today and several later; the trainer must work in both without the caller
knowing about megatron. Megatron's own groups (TP, PP, DP, embedding) are carved out of the default group.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def ensure_default_group() -> bool:
    """Initialise a world-size-1 gloo group unless one exists; return whether this call created it."""
    if dist.is_initialized():
        return False
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


def initialize_model_parallel(tensor_parallel: int, pipeline_parallel: int, seed: int) -> None:
    """Create megatron's groups for this layout (or check the existing ones match) and seed its RNG streams."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as megatron_tp

    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"world size {world} is not a multiple of tensor_model_parallel_size x pipeline_model_parallel_size = "
            f"{tensor_parallel} x {pipeline_parallel}"
        )
    if parallel_state.model_parallel_is_initialized():
        existing = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if existing != (tensor_parallel, pipeline_parallel):
            raise ValueError(
                f"megatron is already initialised with (TP, PP) = {existing}, not ({tensor_parallel}, "
                f"{pipeline_parallel}); one process hosts one parallel layout"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
        )
    torch.manual_seed(seed)
    megatron_tp.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def dp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()
