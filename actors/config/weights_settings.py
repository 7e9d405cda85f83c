"""How new weights travel from the learner to the engines (`RunConfig.weights`, read by the learner's publisher,
actors/learner/publish.py, and by the rollout workers' loaders)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from actors.config.plugin_marks import plugin_for
from actors.config.sections import Section, _is_plugin_path

WEIGHT_BACKENDS = ("auto", "gloo", "nccl", "cuda_ipc", "shm")


class WeightsConfig(Section):
    """How and how often new weights travel from the learner to the engines."""

    weight_transport: str = Field(
        "auto", description="how weights reach the engines: auto (gloo without CUDA, shm when colocated on CPUs, "
        "cuda_ipc when engines share the learner's GPU, nccl otherwise), gloo, nccl, cuda_ipc, shm (shared-memory "
        "files: engines on the learner's host), or module:attr of a WeightTransport plugin",
        json_schema_extra=plugin_for("rollout", "learner", builtins=WEIGHT_BACKENDS))
    update_weights_interval: int = Field(1, ge=1, description="push weights to engines every N learner steps")
    weight_transfer_timeout: float = Field(30.0, gt=0, description="seconds a weight transfer waits for an engine "
                                           "(to join, be ready, acknowledge) before it fails and is retried")
    weight_check: Literal["off", "repush", "strict"] = Field(
        "repush", description="after every push, each engine fingerprints the weights it serves and the learner "
        "compares them with what it sent (RUN_DIR/integrity.json): repush (a mismatch fails the push, which is "
        "tried again), strict (a mismatch stops the run, naming engine and tensor; slime's "
        "--check-weight-update-equal), off")
    weight_check_stride: int = Field(
        16, ge=1, description="a checked push fingerprints one of N slices of each weight matrix's rows (small "
        "tensors whole) and one of N adapted layers, a different one at each version: a tensor never loaded or an "
        "adapter never merged is caught at once, a corruption that stays within N pushes, at about 1/N of the cost; "
        "1 checks every byte of every push (as slime's --check-weight-update-equal does)")
    weight_delta_sync: bool = Field(
        False, description="after a full push, push only the elements that changed since the version the engines "
        "hold (changed indices or a bitmap, and new values, or a tensor whole, whichever is smallest), applied bit "
        "for bit and certified by --weight-check; a full push every --weight-delta-anchor versions and after any "
        "failed or mismatched push. Costs a copy of the pushed weights on the learner and on each engine; pays where "
        "the wire is slow and the push is bfloat16 (docs/reliability.md). torch engines only")
    weight_delta_anchor: int = Field(20, ge=1, description="with --weight-delta-sync, a full push every N versions")
    weight_bucket_bytes: int | None = Field(
        None, ge=1, description="the most bytes of weights one transfer of a push carries: tensors are coalesced into "
        "buckets up to this size (slime's --update-weight-buffer-size); over torch.distributed a tensor of 1 MiB or "
        "more travels alone. Default: the transport's own, 32 MiB over torch.distributed, 512 MiB to SGLang servers")

    @field_validator("weight_transport")
    @classmethod
    def _backend_or_transport_path(cls, value: str) -> str:
        """A backend of the built-in mechanisms, or a plugin's `module:attr` (the learner loads and type-checks it)."""
        if value in WEIGHT_BACKENDS or _is_plugin_path(value):
            return value
        raise ValueError(f"{value!r}: expected {', '.join(WEIGHT_BACKENDS)}, or a weight transport path "
                         "'package.module:attr'")
