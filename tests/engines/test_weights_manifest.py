"""The transfer manifest and the bucket plan both ends derive from it."""

from __future__ import annotations

import json

import pytest
import torch

from engines.weights.group import GroupSpec
from engines.weights.manifest import ALIGNMENT, Manifest, TensorSpec, plan_buckets

SPECS = (
    TensorSpec("embed", torch.float32, (50, 8)),  # 1600 bytes: the largest
    TensorSpec("norm", torch.float32, (8,)),
    TensorSpec("bias", torch.bfloat16, (3,)),
    TensorSpec("step", torch.int64, ()),
    TensorSpec("mask", torch.bool, (5,)),
    TensorSpec("proj", torch.bfloat16, (20, 8)),
)


@pytest.mark.unit
def test_manifest_round_trips_through_its_encoding() -> None:
    manifest = Manifest(version=12, bucket_bytes=4096, direct_bytes=1024, tensors=SPECS)
    assert Manifest.decode(manifest.encode()) == manifest


@pytest.mark.unit
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xff", "not JSON"),
        (json.dumps({"format": 99}).encode(), "expected format 1"),
        (
            json.dumps({"format": 1, "version": 1, "bucket_bytes": 0, "direct_bytes": 1, "tensors": []}).encode(),
            "bucket_bytes must be a positive integer",
        ),
        (
            json.dumps(
                {"format": 1, "version": 1, "bucket_bytes": 8, "direct_bytes": 8, "tensors": [["w", "complex7", [2]]]}
            ).encode(),
            "tensor entry 0 malformed",
        ),
    ],
)
def test_malformed_manifest_is_rejected_with_the_reason(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Manifest.decode(raw)


@pytest.mark.unit
@pytest.mark.parametrize(("bucket_bytes", "direct_bytes"), [(64, 10**6), (700, 10**6), (10**6, 10**6), (4096, 300)])
def test_bucket_plan_covers_every_tensor_once_in_order_within_budget(bucket_bytes: int, direct_bytes: int) -> None:
    buckets = plan_buckets(SPECS, bucket_bytes, direct_bytes)
    order = [index for bucket in buckets for index, _ in bucket.entries]
    assert order == list(range(len(SPECS)))
    for bucket in buckets:
        ends = [offset + SPECS[index].nbytes for index, offset in bucket.entries]
        assert bucket.nbytes == max(ends)
        assert all(offset % ALIGNMENT == 0 for _, offset in bucket.entries)
        assert all(end <= start for end, (_, start) in zip(ends, bucket.entries[1:], strict=False))
        assert len(bucket.entries) == 1 or bucket.nbytes <= bucket_bytes


@pytest.mark.unit
def test_large_tensors_travel_alone() -> None:
    buckets = plan_buckets(SPECS, bucket_bytes=10**6, direct_bytes=300)
    alone = {SPECS[b.entries[0][0]].name for b in buckets if len(b.entries) == 1}
    assert alone == {"embed", "proj"}  # 1600 and 320 bytes; everything else shares one bucket
    assert len(buckets) == 3


@pytest.mark.unit
def test_group_spec_travels_as_plain_values_and_names_strangers() -> None:
    spec = GroupSpec("127.0.0.1", 1234, 3, ("learner", "engine-0", "engine-1"))
    assert GroupSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.rank_of("engine-1") == 2
    with pytest.raises(ValueError, match="'engine-7' is not a member of transfer group generation 3"):
        spec.rank_of("engine-7")
