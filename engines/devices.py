"""Which GPUs this process sees, asked without importing torch where the machine has none.

Placement, the launcher's checks and the weight-transport choice all ask; a machine with no GPU device node is
answered from /dev alone, since importing torch would hold up every actor's start by ~2 s.
"""

from __future__ import annotations

from pathlib import Path


def gpu_device_nodes() -> bool:
    """Whether this machine has NVIDIA or AMD GPU device nodes: a cheap first answer, without importing torch."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def visible_gpus() -> int:
    """GPUs this process sees (its CUDA_VISIBLE_DEVICES applies); 0 without CUDA."""
    if not gpu_device_nodes():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
