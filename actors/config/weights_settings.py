"""How new weights travel from the learner to the engines (`RunConfig.weights`, read by the learner's publisher,
actors/learner/publish.py, and by the rollout workers' loaders)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from actors.config.plugin_marks import plugin_for
from actors.config.sections import Section, _is_plugin_path

WEIGHT_BACKENDS = ("auto", "gloo", "nccl", "cuda_ipc", "shm", "disk")


class WeightsConfig(Section):
    """How and how often new weights travel from the learner to the engines."""

    weight_transport: str = Field(
        "auto", description="how weights reach the engines: auto (gloo without CUDA, shm when colocated on CPUs, "
        "cuda_ipc when engines share the learner's GPU, nccl otherwise), gloo, nccl, cuda_ipc, shm (shared-memory "
        "files: engines on the learner's host), disk (each push written into --weight-disk-dir, a folder the learner "
        "and every engine see: no process group between them; slime's --update-weight-transport disk), or "
        "module:attr of a WeightTransport plugin",
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
        "failed or mismatched push, and for a while after a delta that was slower than a full push "
        "(--weight-delta-backoff). Costs a copy of the pushed weights on the learner and on each engine; pays where "
        "the wire is slow and the push is bfloat16 (docs/reliability.md). torch engines over any torch transport; "
        "SGLang servers through --weight-transport disk with --weight-disk-local-dir (each host's local checkpoint "
        "is patched and reloaded: SGLang has no delta endpoint)")
    weight_delta_anchor: int = Field(20, ge=1, description="with --weight-delta-sync, a full push every N versions")
    weight_delta_backoff: int = Field(
        8, ge=0, description="with --weight-delta-sync, after a delta push that took longer than a full push of the "
        "same weights (the last full push's seconds per byte), push whole for N versions, then try a delta again "
        "(twice as long after each slower try in a row, up to 16 N): a delta pays only where the wire is slower than "
        "diffing, as across nodes; 0 keeps deltas whatever they cost")
    rollout_fp8: bool = Field(
        False, description="the engines serve the decoder's projections in FP8 (float8_e4m3fn with a float32 scale "
        "per 128x128 tile: SGLang's weight_scale_inv layout) and compute as SGLang's W8A8 block kernels do; the "
        "learner trains in full precision and quantises them at each push (a LoRA run: the engines quantise the base "
        "once and merge the adapter over it). The train/rollout mismatch this makes is what --off-policy-correction "
        "corrects (docs/fp8.md)")
    weight_bucket_bytes: int | None = Field(
        None, ge=1, description="the most bytes of weights one transfer of a push carries: tensors are coalesced into "
        "buckets up to this size (slime's --update-weight-buffer-size); over torch.distributed a tensor of 1 MiB or "
        "more travels alone. Default: the transport's own, 32 MiB over torch.distributed, 512 MiB to SGLang servers")

    weight_disk_dir: str | None = Field(
        None, description="with --weight-transport disk: the folder each push is written into (weight_vNNNNNN/, "
        "safetensors under the pushed names) and every engine reads it from, under the same path everywhere "
        "(slime's --update-weight-disk-dir)")
    weight_disk_keep_files: bool = Field(
        False, description="with --weight-transport disk: keep each version's folder after its push (by default it "
        "is removed once the push is over; slime's --update-weight-disk-keep-files)")
    weight_disk_local_dir: str | None = Field(
        None, description="with --weight-transport disk: each engine copies a push into DIR/<engine> on its own disk "
        "and reads it from there (slime's --update-weight-local-checkpoint-dir)")
    weight_disk_post_write_path: str | None = Field(
        None, description="with --weight-transport disk: module:attr of fn(args, version_dir, engines), called on "
        "the learner once a push's files are written and before any engine reads them, to publish them on a "
        "filesystem without cross-host read-after-write consistency (slime's --custom-update-weight-post-write-path "
        "and signature; engines are the receiving rollout workers' names)")

    @model_validator(mode="after")
    def _disk_settings(self) -> WeightsConfig:
        """The folder is what the disk transport is; its other settings mean nothing without it."""
        disk = self.weight_transport == "disk"
        if disk and not self.weight_disk_dir:
            raise ValueError("--weight-transport disk needs --weight-disk-dir (a folder the learner and every engine "
                             "see under the same path)")
        given = [name for name, value in (("weight_disk_dir", self.weight_disk_dir),
                                          ("weight_disk_keep_files", self.weight_disk_keep_files),
                                          ("weight_disk_local_dir", self.weight_disk_local_dir),
                                          ("weight_disk_post_write_path", self.weight_disk_post_write_path)) if value]
        if given and not disk:
            raise ValueError(f"{', '.join(given)}: only with --weight-transport disk (this run: "
                             f"{self.weight_transport})")
        if self.weight_disk_post_write_path and not _is_plugin_path(self.weight_disk_post_write_path):
            raise ValueError(f"weight_disk_post_write_path {self.weight_disk_post_write_path!r}: expected "
                             "'package.module:attr'")
        return self

    @field_validator("weight_transport")
    @classmethod
    def _backend_or_transport_path(cls, value: str) -> str:
        """A backend of the built-in mechanisms, or a plugin's `module:attr` (the learner loads and type-checks it)."""
        if value in WEIGHT_BACKENDS or _is_plugin_path(value):
            return value
        raise ValueError(f"{value!r}: expected {', '.join(WEIGHT_BACKENDS)}, or a weight transport path "
                         "'package.module:attr'")
