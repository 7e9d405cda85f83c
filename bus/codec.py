"""Frames <-> messages: msgpack maps through msgspec, tensors as ext types, hostile input as one error type.

Why msgspec: it decodes straight into the typed structs of ``bus.schema`` and validates while decoding, in C.
Measured with ``tools/bench/bus_speed.py`` (codec table) it is faster than msgpack-python followed by hand
validation, and the wire stays plain msgpack maps either way.

Decode limits, and where each is enforced:

- ``max_frame_bytes``: before parsing (and by the channels as ZMQ_MAXMSGSIZE, so libzmq drops an oversized
  frame, and the peer that sent it, before allocating it).
- ``max_tensor_bytes``: in the ext hook, before the tensor view exists (views allocate nothing anyway).
- ``max_depth`` and ``max_collection_len``: checked on the decoded message. msgspec never pre-allocates from a
  length header (a header claiming 2**32 items in a short frame fails as truncated at once) and stops
  runaway nesting with RecursionError, so the memory a hostile frame can cost is bounded by its size: at
  worst ~70x for a frame made of one-byte empty maps inside an ``any`` field. Receivers that face untrusted
  peers should lower ``max_frame_bytes`` accordingly.

``decode`` raises only ``DecodeError``; its ``reason`` is a short key for drop counters.
"""

from __future__ import annotations

import functools
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from bus.schema import DEFAULT_VERSION, SCHEMA_VERSION, AnyMessage, Message
from bus.tensors import (
    EXT_NDARRAY,
    EXT_TORCH,
    TensorFormatError,
    TensorTooLarge,
    decode_tensor,
    encode_ndarray,
    encode_torch,
)

MiB = 1 << 20

REASONS = (
    "too_large",
    "bad_msgpack",
    "unknown_type",
    "bad_schema",
    "bad_version",
    "bad_tensor",
    "too_deep",
    "too_long",
)


class DecodeError(ValueError):
    """A frame that is not a valid message; ``reason`` is one of ``REASONS`` (a metric key)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds a receiver enforces on every frame; see the module docstring for where each applies."""

    max_frame_bytes: int = 256 * MiB
    max_depth: int = 32
    max_collection_len: int = 1 << 20
    max_tensor_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_depth", "max_collection_len", "max_tensor_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = DecodeLimits()


# ---------------------------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if type(obj) is type(DEFAULT_VERSION):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return msgspec.msgpack.Ext(*encode_ndarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return msgspec.msgpack.Ext(*encode_torch(obj))
    raise TypeError(f"cannot encode a {type(obj).__module__}.{type(obj).__qualname__} on the bus")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: Message) -> bytes:
    """One msgpack frame for ``message``; raises TypeError for values the wire cannot carry."""
    if not isinstance(message, Message):
        raise TypeError(f"encode() takes a bus.schema message, got {type(message).__name__}")
    return _ENCODER.encode(message)


def encode_into(message: Message, buffer: bytearray) -> None:
    """Encode into ``buffer`` (resized to fit; its allocation is reused across calls, unlike ``encode``)."""
    if not isinstance(message, Message):
        raise TypeError(f"encode_into() takes a bus.schema message, got {type(message).__name__}")
    _ENCODER.encode_into(message, buffer)


def validate(message: Message) -> Message:
    """``message`` itself when every field holds what the schema allows, else a ValueError naming the message type
    and the field: what ``decode`` would refuse on arrival, checked on the sender's object without encoding it.

    Structs are not validated when constructed, so a sender that wants a bad value to be its own error (not a
    frame the receiver drops) asks here. Nested structs (a batch's samples) are checked the same way.
    """
    if not isinstance(message, Message):
        raise TypeError(f"validate() takes a bus.schema message, got {type(message).__name__}")
    _validate_struct(message, type(message).__name__)
    return message


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    """(field, annotated type) of every field of ``cls`` but the schema version, which the encoder writes."""
    module = sys.modules[cls.__module__]
    hints = typing.get_type_hints(cls, globalns=vars(module), include_extras=True)
    return tuple((name, hint) for name, hint in hints.items() if name in cls.__struct_fields__ and name != "v")


def _validate_struct(value: msgspec.Struct, where: str) -> None:
    for name, hint in _field_types(type(value)):
        field = getattr(value, name)
        try:
            msgspec.convert(_as_sent(field), hint)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{where}.{name}: {exc}") from None
        _validate_nested(field, f"{where}.{name}")


def _as_sent(value: Any) -> Any:
    """A numpy scalar as the encoder writes it (its Python value); everything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _validate_nested(value: Any, where: str) -> None:
    """The structs inside an already valid field, which ``msgspec.convert`` passes through as they are."""
    if isinstance(value, msgspec.Struct):
        _validate_struct(value, f"{where}<{type(value).__name__}>")
    elif type(value) in (list, tuple):
        for index, item in enumerate(value):
            _validate_nested(item, f"{where}[{index}]")
    elif type(value) is dict:
        for key, item in value.items():
            _validate_nested(item, f"{where}[{key!r}]")


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


class _Probe(msgspec.Struct):
    """Just the envelope, read only after a validation failure to say which kind of failure it was."""

    type: Any = None
    v: Any = None


_PROBE = msgspec.msgpack.Decoder(_Probe)
_KNOWN_TYPES = {cls.__name__ for cls in typing.get_args(AnyMessage)}


class Decoder:
    """``decode`` bound to one set of limits; channels hold one to skip the per-call lookup."""

    def __init__(self, limits: DecodeLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.msgspec = msgspec.msgpack.Decoder(AnyMessage, ext_hook=self._ext_hook)

    def decode(self, frame: bytes | bytearray | memoryview | Any) -> Message:
        """Decode one frame (bytes, memoryview or zmq.Frame) into its message; raise only DecodeError.

        Arrays in the result are views of ``frame``'s buffer, which they keep alive.
        """
        limits = self.limits
        buffer = getattr(frame, "buffer", frame)  # zmq.Frame -> its memoryview, without copying
        try:
            size = memoryview(buffer).nbytes
        except TypeError:
            raise DecodeError("bad_msgpack", f"cannot decode a {type(frame).__name__}; expected bytes") from None
        if size > limits.max_frame_bytes:
            raise DecodeError("too_large", f"frame of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
        try:
            message = self.msgspec.decode(buffer)
        except DecodeError:
            raise
        except msgspec.ValidationError as exc:
            raise _classify(buffer, size, exc) from None
        except msgspec.DecodeError as exc:
            raise DecodeError("bad_msgpack", f"frame of {size} bytes is not valid msgpack: {exc}") from None
        except RecursionError:
            raise DecodeError("too_deep", f"frame of {size} bytes nests deeper than the decoder allows") from None
        except MemoryError:
            raise DecodeError("too_large", f"frame of {size} bytes could not be materialised") from None
        except Exception as exc:  # anything else msgspec or a hook can raise on garbage
            raise DecodeError("bad_msgpack", f"frame of {size} bytes: {type(exc).__name__}: {exc}") from None
        if message.v is DEFAULT_VERSION:
            raise DecodeError("bad_version", f'{type(message).__name__} frame has no "v" (schema version) key')
        if message.v != SCHEMA_VERSION:
            raise DecodeError(
                "bad_version", f"{type(message).__name__} frame has v={message.v}, we speak {SCHEMA_VERSION}"
            )
        _check_shape(message, 1, limits)
        return message

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_NDARRAY, EXT_TORCH):
            raise DecodeError("bad_tensor", f"unknown msgpack ext type {code} (known: 1 = ndarray, 2 = torch)")
        try:
            return decode_tensor(code, data, self.limits.max_tensor_bytes)
        except TensorFormatError as exc:
            raise DecodeError("too_large" if isinstance(exc, TensorTooLarge) else "bad_tensor", str(exc)) from None


_DECODERS: dict[DecodeLimits, Decoder] = {}


def decoder_for(limits: DecodeLimits) -> Decoder:
    """The shared Decoder for ``limits`` (msgspec decoders are reusable and thread-safe)."""
    decoder = _DECODERS.get(limits)
    if decoder is None:
        decoder = _DECODERS[limits] = Decoder(limits)
    return decoder


def decode(frame: bytes | bytearray | memoryview | Any, limits: DecodeLimits = DEFAULT_LIMITS) -> Message:
    """Decode one frame (bytes, memoryview or zmq.Frame) into its message; raise only DecodeError.

    Arrays in the result are views of ``frame``'s buffer, which they keep alive.
    """
    return decoder_for(limits).decode(frame)


def _classify(buffer: Any, size: int, exc: msgspec.ValidationError) -> DecodeError:
    try:
        probe = _PROBE.decode(buffer)
    except Exception:
        return DecodeError("bad_schema", f"frame of {size} bytes is not a msgpack map: {exc}")
    name, version = probe.type, probe.v
    version_ok = type(version) is int and version == SCHEMA_VERSION
    if not isinstance(name, str) or name not in _KNOWN_TYPES:
        if type(version) is int and not version_ok:
            return DecodeError("bad_version", f"frame of type {name!r} has v={version}, we speak {SCHEMA_VERSION}")
        return DecodeError("unknown_type", f"frame of {size} bytes has unknown type {name!r}: {exc}")
    if not version_ok:
        return DecodeError("bad_version", f"{name} frame has v={version!r}, we speak {SCHEMA_VERSION}")
    return DecodeError("bad_schema", f"{name} frame ({size} bytes): {exc}")


# Which struct fields can hold containers, and whether those containers can hold more containers.
_SCALARS = (str, int, float, bool, type(None), np.ndarray)


def _holds_containers(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp in _SCALARS or origin is typing.Literal:
        return False
    if origin in (typing.Union, types.UnionType):
        return any(_holds_containers(arg) for arg in typing.get_args(tp))
    return True


@functools.cache
def _fields_to_check(cls: type) -> tuple[tuple[str, bool], ...]:
    """(field, deep) for every field that can hold a container; deep=False: a flat list/dict of scalars."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        if name == "v" or not _holds_containers(tp):
            continue
        args = typing.get_args(tp)
        flat = typing.get_origin(tp) in (list, dict) and not any(_holds_containers(arg) for arg in args)
        out.append((name, not flat))
    return tuple(out)


def _check_shape(value: Any, depth: int, limits: DecodeLimits) -> None:
    if depth > limits.max_depth:
        raise DecodeError("too_deep", f"message nests deeper than max_depth={limits.max_depth}")
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        if len(value) > limits.max_collection_len:
            raise DecodeError(
                "too_long",
                f"a {kind.__name__} of {len(value)} items exceeds max_collection_len={limits.max_collection_len}",
            )
        items = value.values() if kind is dict else value
        for item in items:
            if type(item) in (dict, list, tuple) or isinstance(item, msgspec.Struct):
                _check_shape(item, depth + 1, limits)
        if kind is dict:
            for key in value:
                if type(key) is tuple:
                    _check_shape(key, depth + 1, limits)
    elif isinstance(value, msgspec.Struct):
        if isinstance(value, Message) and value.v != SCHEMA_VERSION:
            raise DecodeError("bad_version", f"nested {kind.__name__} has v={value.v}, we speak {SCHEMA_VERSION}")
        for name, deep in _fields_to_check(kind):
            field = getattr(value, name)
            if deep:
                _check_shape(field, depth + 1, limits)
            elif field is not None and len(field) > limits.max_collection_len:
                raise DecodeError(
                    "too_long",
                    f"{kind.__name__}.{name} has {len(field)} items, exceeds max_collection_len="
                    f"{limits.max_collection_len}",
                )
