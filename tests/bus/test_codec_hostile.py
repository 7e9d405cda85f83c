"""Hostile and malformed frames: one error type with a reason, no crash, hang or large allocation."""

from __future__ import annotations

import struct
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.codec import DecodeError, DecodeLimits, decode, encode
from bus.schema import Batch, Heartbeat, Message, Sample

LIMITS = DecodeLimits(max_frame_bytes=1 << 20, max_depth=8, max_collection_len=100, max_tensor_bytes=1024)


def _reason(frame: bytes, limits: DecodeLimits = LIMITS) -> str:
    with pytest.raises(DecodeError) as caught:
        decode(frame, limits)
    return caught.value.reason


def _heartbeat(**overrides: object) -> bytes:
    fields = {"type": "Heartbeat", "v": 1, "actor_id": "a", "seq": 1} | overrides
    return msgpack.packb({k: v for k, v in fields.items() if v is not ...})


def _tensor_ext(dtype: bytes, shape: tuple[int, ...], data: bytes, code: int = 1) -> msgpack.ExtType:
    header = bytes([len(dtype)]) + dtype + bytes([len(shape)]) + struct.pack(f"<{len(shape)}Q", *shape)
    return msgpack.ExtType(code, header + data)


def _sample_frame(**overrides: object) -> bytes:
    fields = {"type": "Sample", "v": 1, "sample_id": "g/0", "group_id": "g", "index": 0, "prompt": "p"}
    return msgpack.packb(fields | overrides)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "bad_msgpack"),
        (b"\xc1", "bad_msgpack"),
        (_heartbeat() + b"\x00", "bad_msgpack"),
        (_heartbeat()[:-3], "bad_msgpack"),
        (msgpack.packb(5), "bad_schema"),
        (_heartbeat(type="Shutdown"), "unknown_type"),
        (_heartbeat(type=...), "unknown_type"),
        (_heartbeat(v=2), "bad_version"),
        (_heartbeat(v=...), "bad_version"),
        (_heartbeat(v="1"), "bad_version"),
        (_heartbeat(seq="one"), "bad_schema"),
        (_heartbeat(actor_id=...), "bad_schema"),
        (_heartbeat(counters={"x": "not a float"}), "bad_schema"),
        (_sample_frame(status="lost"), "bad_schema"),
        (_sample_frame(tokens=_tensor_ext(b"int32", (2,), bytes(8)), response_length=3), "bad_schema"),
        (_sample_frame(tokens=_tensor_ext(b"int64", (2,), bytes(16)), response_length=2), "bad_schema"),
        (_sample_frame(tokens=[1, 2], response_length=2), "bad_schema"),
        (_sample_frame(metadata={"x": _tensor_ext(b"int32", (3,), bytes(8))}), "bad_tensor"),
        (_sample_frame(metadata={"x": _tensor_ext(b"int33", (1,), bytes(4))}), "bad_tensor"),
        (_sample_frame(metadata={"x": _tensor_ext(b"bool", (2,), b"\x01\x02")}), "bad_tensor"),
        (_sample_frame(metadata={"x": _tensor_ext(b"int32", (1,), bytes(4), code=7)}), "bad_tensor"),
        (_sample_frame(metadata={"x": _tensor_ext(b"bfloat16", (1,), bytes(2), code=1)}), "bad_tensor"),
        (_sample_frame(metadata={"x": msgpack.ExtType(1, b"\x05int32\x02")}), "bad_tensor"),
        (_sample_frame(metadata={"x": _tensor_ext(b"uint8", (2048,), bytes(2048))}), "too_large"),
        (_sample_frame(metadata={"x": [[[[[[[[[1]]]]]]]]]}), "too_deep"),
        (_sample_frame(metadata={"x": list(range(101))}), "too_long"),
        (msgpack.packb({"type": "Batch", "v": 1, "batch_id": 1, "samples": [], "staleness": [0] * 101}), "too_long"),
        (msgpack.packb({"type": "Batch", "v": 1, "batch_id": 1, "staleness": [], "samples": [
            {"type": "Sample", "v": 2, "sample_id": "g/0", "group_id": "g", "index": 0, "prompt": "p"}]}),
         "bad_version"),
        (b"\x81\xa4type" + b"\xda" + struct.pack(">H", 2000) + b"x" * 2000, "unknown_type"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)  # fmt: skip
def test_malformed_frame_is_rejected_with_its_reason(frame: bytes, reason: str) -> None:
    assert _reason(frame) == reason


@pytest.mark.unit
def test_rejection_message_names_the_type_and_the_field() -> None:
    with pytest.raises(DecodeError, match=r"Heartbeat frame \(\d+ bytes\): Expected `int`, got `str` - at `\$.seq`"):
        decode(_heartbeat(seq="one"))


@pytest.mark.unit
def test_frame_over_the_size_limit_is_refused_before_parsing() -> None:
    frame = encode(Heartbeat(actor_id="x" * 2000, seq=1))
    assert _reason(frame, DecodeLimits(max_frame_bytes=1000)) == "too_large"


@pytest.mark.unit
@pytest.mark.parametrize(
    "header", [b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9\x01"]
)  # array32 map32 str32 bin32 ext32
def test_length_headers_claiming_gigabytes_allocate_nothing(header: bytes) -> None:
    frame = b"\x83\xa4type\xa6Sample\xa1v\x01\xa8metadata\x81\xa1x" + header[:1] + b"\xff\xff\xff\xff" + header[1:]
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(DecodeError):
        decode(frame)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"decoding a {len(frame)}-byte frame peaked at {peak} bytes"
    assert elapsed < 1.0


@pytest.mark.unit
def test_nesting_beyond_the_interpreter_limit_is_too_deep_not_a_crash() -> None:
    frame = b"\x83\xa4type\xa6Sample\xa1v\x01\xa8metadata\x81\xa1x" + b"\x91" * 200_000 + b"\xc0"
    assert _reason(frame, DecodeLimits()) == "too_deep"


def _is_message_or_decode_error(frame: bytes) -> bool:
    try:
        return isinstance(decode(frame, LIMITS), Message)
    except DecodeError:
        return True


_VALID = [
    encode(Heartbeat(actor_id="worker", seq=7, counters={"a": 1.5})),
    encode(
        Batch(
            batch_id=3,
            staleness=[0],
            samples=[
                Sample(sample_id="g/0", group_id="g", index=0, prompt=[{"role": "user", "content": "hi"}],
                       prompt_tokens=2, tokens=[1, 2, 3], response_length=1,
                       rollout_log_probs=np.array([-0.1], np.float32), metadata={"k": [1, {"z": None}]})
            ],
        )
    ),
]  # fmt: skip


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(frame=st.binary(max_size=256))
def test_random_bytes_only_ever_raise_decode_error(frame: bytes) -> None:
    assert _is_message_or_decode_error(frame)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(
    which=st.sampled_from(range(len(_VALID))),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from("sid")), min_size=1,
                   max_size=4),
)  # fmt: skip
def test_mutated_valid_frames_only_ever_raise_decode_error(which: int, edits: list[tuple[int, int, str]]) -> None:
    frame = bytearray(_VALID[which])
    for position, value, kind in edits:
        at = position % (len(frame) + 1)
        if kind == "s" and at < len(frame):
            frame[at] = value
        elif kind == "i":
            frame.insert(at, value)
        elif kind == "d" and at < len(frame):
            del frame[at]
    assert _is_message_or_decode_error(bytes(frame))
