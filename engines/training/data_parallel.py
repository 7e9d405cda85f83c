"""Data parallelism for the torch trainer: DDP whose all-reduce SUMS the ranks' gradients.

The trainer's losses are divided by counts of the whole step over every rank (`engines.training.base.Loss`), so
each rank's gradient is already its share of the step's; DDP's default all-reduce would divide them by the world
size once more. Under context parallelism the ranks of a group hold disjoint parts of one micro-batch's gradient,
and the same sum adds them up.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


def summing_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """`model` in DDP whose all-reduce sums the ranks' gradients (see `_sum_gradients_hook`)."""
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_buffer_sync_off()
    )
    ddp.register_comm_hook(state=None, hook=_sum_gradients_hook)
    return ddp


def ddp_buffer_sync_off(ddp_init: Callable[..., None] = DistributedDataParallel.__init__) -> dict[str, bool]:
    """DDP's flag for not broadcasting buffers before every forward (ours, the rotary tables, are the same on every
    rank and never trained). torch 2.13 renamed it `forward_sync_buffers`; older releases, which GPU images ship,
    know only `broadcast_buffers` and refuse the new name."""
    if "forward_sync_buffers" in inspect.signature(ddp_init).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _sum_gradients_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP's all-reduce without its division by world size (losses are already globally normalised)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


# DDP validates a hook's annotations by identity; postponed (string) annotations would fail that check.
_sum_gradients_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
