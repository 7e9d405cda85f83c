"""Codec: every message type round-trips exactly; tensors travel without pickle or copies."""

from __future__ import annotations

import re

import msgpack
import numpy as np
import pytest
import torch
from bus_strategies import strategy_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.codec import DecodeError, decode, encode, encode_into, validate
from bus.schema import MESSAGE_TYPES, Batch, Heartbeat, Message, Sample, VersionAnnouncement, messages_equal

ROUND_TRIP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.unit
@pytest.mark.parametrize("message_type", list(MESSAGE_TYPES.values()), ids=list(MESSAGE_TYPES))
@ROUND_TRIP
@given(data=st.data())
def test_every_valid_message_of_every_type_passes_validation_unchanged_and_round_trips_exactly(
        message_type: type[Message], data: st.DataObject) -> None:
    message = data.draw(strategy_for(message_type))
    assert validate(message) is message
    assert messages_equal(decode(encode(message)), message)


@pytest.mark.unit
def test_frame_is_a_plain_msgpack_map_with_type_and_version() -> None:
    frame = encode(Heartbeat(actor_id="rollout-0", seq=3, counters={"dropped": 1.0}))
    assert msgpack.unpackb(frame) == {
        "type": "Heartbeat",
        "v": 1,
        "actor_id": "rollout-0",
        "seq": 3,
        "counters": {"dropped": 1.0},
        "progress": 0,
        "waits": [],
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    "dtype", ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
              "float32", "float64", "complex64", "complex128"]
)  # fmt: skip
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4)], ids=str)
def test_numpy_arrays_keep_dtype_shape_and_bytes(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2, shape) if dtype == "bool" else rng.standard_normal(shape) * 100
    array = np.asarray(values, dtype=dtype)
    decoded = decode(encode(_carrier(array)))
    assert messages_equal(decoded.metadata["x"], array)


def _carrier(value: object) -> Sample:
    return Sample(sample_id="g/0", group_id="g", index=0, prompt="p", metadata={"x": value})


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool])
def test_torch_tensors_come_back_as_torch_with_their_dtype(dtype: torch.dtype) -> None:
    tensor = (torch.randn(3, 4) * 10).to(dtype)
    decoded = decode(encode(_carrier(tensor))).metadata["x"]
    assert isinstance(decoded, torch.Tensor)
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


@pytest.mark.unit
def test_non_contiguous_and_big_endian_arrays_arrive_as_the_same_values() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    strided, big_endian = base[:, ::2], base.astype(">i4")
    message = _carrier([strided, big_endian, torch.arange(12.0).reshape(3, 4).t()])
    decoded = decode(encode(message)).metadata["x"]
    np.testing.assert_array_equal(decoded[0], strided)
    np.testing.assert_array_equal(decoded[1], base)
    assert decoded[1].dtype == np.dtype("<i4")
    assert torch.equal(decoded[2], torch.arange(12.0).reshape(3, 4).t())


@pytest.mark.unit
def test_decoded_arrays_are_read_only_views_of_the_frame() -> None:
    tokens = np.arange(1000, dtype=np.int32)
    sample = Sample(sample_id="g/0", group_id="g", index=0, prompt="p", tokens=tokens, prompt_tokens=1000)
    frame = bytearray(encode(sample))
    decoded = decode(frame)
    assert not decoded.tokens.flags.writeable
    assert np.shares_memory(decoded.tokens, np.frombuffer(frame, dtype=np.uint8))
    position = frame.find(tokens[1:].tobytes())
    frame[position : position + 4] = np.int32(-7).tobytes()  # the array sees the frame's bytes, not a copy
    assert decoded.tokens[1] == -7


@pytest.mark.unit
def test_encode_into_reuses_one_buffer_and_matches_encode() -> None:
    buffer = bytearray()
    for seq in (1, 2):
        message = Heartbeat(actor_id="a", seq=seq)
        encode_into(message, buffer)
        assert bytes(buffer) == encode(message)


@pytest.mark.unit
def test_sample_lists_become_int32_arrays() -> None:
    sample = Sample(sample_id="g/0", group_id="g", index=0, prompt="p", prompt_tokens=1, tokens=[5, 6, 7],
                    response_length=2, token_versions=[3, 3])  # fmt: skip
    assert sample.tokens.dtype == np.int32 and sample.token_versions.dtype == np.int32


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"prompt_tokens": 1, "tokens": [1, 2], "response_length": 2}, "response_length=2"),
        ({"prompt_tokens": 3, "tokens": [1, 2], "response_length": -1}, "prompt_tokens=3"),
        ({"tokens": np.zeros(2, np.int64), "response_length": 2}, "Sample.tokens: dtype int64"),
        ({"tokens": [1, 2], "response_length": 2, "rollout_log_probs": np.zeros(1, np.float32)}, "1 entries"),
        ({"tokens": np.zeros((1, 2), np.int32), "response_length": 2}, "1-D"),
        ({"tokens": [1, 2, 3], "response_length": 3, "step_ends": [0, 2]}, "come together"),
        ({"tokens": [1, 2, 3], "response_length": 3, "step_ends": [0, 2], "step_rewards": [1.0]},
         "1 entries for 2 step_ends"),
        ({"tokens": [1, 2, 3], "response_length": 3, "step_ends": [0, 3], "step_rewards": [1.0, 0.0]},
         r"response token indices in 0\.\.2, in order"),
        ({"tokens": [1, 2, 3], "response_length": 3, "step_ends": [2, 1], "step_rewards": [1.0, 0.0]}, "in order"),
        ({"tokens": [1, 2, 3], "response_length": 3, "step_ends": [2], "step_rewards": [np.nan]}, "must be finite"),
    ],
)
def test_sample_rejects_arrays_that_do_not_line_up(fields: dict, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        Sample(sample_id="g/0", group_id="g", index=0, prompt="p", **fields)


@pytest.mark.unit
def test_encode_refuses_what_the_wire_cannot_carry() -> None:
    with pytest.raises(TypeError, match=r"bus\.schema message"):
        encode({"type": "Heartbeat"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"numpy dtype dtype\('O'\)"):
        encode(_carrier(np.array([object()])))
    with pytest.raises(TypeError, match=r"cannot encode a builtins\.object"):
        encode(_carrier(object()))


@pytest.mark.unit
def test_nested_samples_keep_their_types_inside_a_batch() -> None:
    sample = Sample(sample_id="g/0", group_id="g", index=0, prompt="p", prompt_tokens=1, tokens=[1, 2],
                    response_length=1, rollout_log_probs=np.array([-0.5], np.float32), reward=1.0)  # fmt: skip
    batch = Batch(batch_id=1, samples=[sample, sample], staleness=[0, 1])
    decoded = decode(encode(batch))
    assert isinstance(decoded, Batch) and all(isinstance(s, Sample) for s in decoded.samples)
    assert messages_equal(decoded, batch)


@pytest.mark.unit
def test_decode_accepts_bytes_bytearray_and_memoryview_alike() -> None:
    frame = encode(Heartbeat(actor_id="a", seq=1))
    decoded = [decode(frame), decode(bytearray(frame)), decode(memoryview(frame))]
    assert all(messages_equal(d, decoded[0]) for d in decoded)
    with pytest.raises(DecodeError):
        decode("not bytes")  # type: ignore[arg-type]


@pytest.mark.unit
def test_version_announcement_before_any_weight_push_decodes() -> None:
    """A learner that resumed and has not pushed weights yet announces weights_version None; the controller must
    accept it (it used to reject the frame, and that announcement was lost)."""
    from bus.schema import VersionAnnouncement

    decoded = decode(encode(VersionAnnouncement(version=7, weights_version=None, step=7)))
    assert isinstance(decoded, VersionAnnouncement)
    assert decoded.version == 7 and decoded.weights_version is None


def _bad_sample() -> Sample:
    return Sample(sample_id="g/0", group_id="g", index=0, prompt="p", prompt_tokens=1, tokens=[1, 2],
                  response_length=1, reward="high")  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize(("make", "field"), [
    (lambda: VersionAnnouncement(version="3"), "VersionAnnouncement.version"),  # type: ignore[arg-type]
    (lambda: VersionAnnouncement(version=3, weights_version=1.5), "VersionAnnouncement.weights_version"),  # type: ignore[arg-type]
    (lambda: VersionAnnouncement(version=True), "VersionAnnouncement.version"),
    (lambda: Batch(batch_id=1, samples=[_bad_sample()], staleness=[0]), "Batch.samples[0]<Sample>.reward"),
], ids=["str-for-int", "float-for-int-or-null", "bool-for-int", "nested-sample"])
def test_validation_refuses_what_the_receiver_would_drop_and_names_the_field(make, field: str) -> None:
    message = make()
    with pytest.raises(DecodeError):  # what a receiver would do with the frame: drop it
        decode(encode(message))
    with pytest.raises(ValueError, match=re.escape(field)):
        validate(message)


@pytest.mark.unit
def test_validation_takes_numpy_scalars_as_the_encoder_writes_them() -> None:
    message = VersionAnnouncement(version=np.int64(4), step=np.int32(4), timestamp=np.float32(1.5))  # type: ignore[arg-type]
    assert messages_equal(decode(encode(message)), VersionAnnouncement(version=4, step=4, timestamp=1.5))
    assert validate(message) is message
