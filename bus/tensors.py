"""Tensors on the wire: numpy arrays and torch tensors as msgpack extension types.

Payload of both ext types (all integers little-endian)::

    u8 dtype_len | dtype (ASCII, dtype_len bytes) | u8 ndim | ndim x u64 dims | raw element bytes (C order, LE)

Ext type 1 decodes to a numpy array, ext type 2 to a torch tensor, so a value comes back as the kind it was
sent as. The header is fixed binary rather than nested msgpack so a foreign implementation needs no
streaming msgpack parser to find where the elements start, and so decoding is a struct unpack plus a view.

Decoding never copies element bytes for numpy: the array is a read-only view of the received frame (the
frame stays alive as long as the array does). torch has no read-only tensors, so a decoded torch tensor
aliases the frame and is technically writable; treat it as read-only and ``clone()`` before in-place ops.
torch views are made only when the data is aligned to the element size, otherwise the bytes are copied
(numpy handles unaligned views itself; not every torch kernel is guaranteed to).

torch is imported lazily: the bus works (and decodes numpy payloads) where torch is not installed.
"""

from __future__ import annotations

import struct
import sys
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

EXT_NDARRAY = 1
EXT_TORCH = 2

MAX_NDIM = 32

# Wire dtype names (numpy spelling, plus torch's bfloat16) -> numpy dtype. bfloat16 has no numpy dtype.
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in NUMPY_DTYPES.items()} | {"bfloat16": 2}
WIRE_DTYPES: tuple[str, ...] = tuple(ITEMSIZE)

_DIM = struct.Struct("<Q")


class TensorFormatError(ValueError):
    """A tensor ext payload is malformed; the codec turns it into DecodeError(reason="bad_tensor")."""


class TensorTooLarge(TensorFormatError):
    """A tensor over ``max_tensor_bytes``; the codec turns it into DecodeError(reason="too_large")."""


_NAME_PREFIX: dict[str, bytes] = {name: bytes((len(name),)) + name.encode("ascii") for name in ITEMSIZE}
# numpy dtype (any byte order) -> wire name; a dict lookup, because dtype.name is a slow Python property.
_NAME_BY_NUMPY_DTYPE: dict[np.dtype, str] = {dt: name for name, dt in NUMPY_DTYPES.items()} | {
    dt.newbyteorder(">"): name for name, dt in NUMPY_DTYPES.items()
}


def _header(dtype: str, shape: tuple[int, ...]) -> bytes:
    if len(shape) > MAX_NDIM:
        raise TypeError(f"cannot encode a tensor with {len(shape)} dimensions (max {MAX_NDIM})")
    dims = _DIM.pack(shape[0]) if len(shape) == 1 else struct.pack(f"<{len(shape)}Q", *shape)
    return _NAME_PREFIX[dtype] + bytes((len(shape),)) + dims


def _payload(header: bytes, contiguous: Any) -> bytes:
    """Header and element bytes in one buffer (one copy; msgspec copies it once more into the frame)."""
    return b"".join((header, contiguous))  # join reads any C-contiguous buffer as raw bytes


def encode_ndarray(array: np.ndarray) -> tuple[int, bytes]:
    name = _NAME_BY_NUMPY_DTYPE.get(array.dtype)
    if name is None:
        raise TypeError(f"cannot encode numpy dtype {array.dtype!r}; supported: {', '.join(NUMPY_DTYPES)}")
    wire = NUMPY_DTYPES[name]
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(wire)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array) if array.ndim else array.copy()
    return EXT_NDARRAY, _payload(_header(name, array.shape), array)


def encode_torch(tensor: torch.Tensor) -> tuple[int, bytes]:
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"cannot encode a {tensor.layout} / quantized torch tensor; convert it to a dense tensor")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise TypeError(f"cannot encode torch dtype {tensor.dtype}; supported: {', '.join(WIRE_DTYPES)}")
    if sys.byteorder != "little" and ITEMSIZE[name] > 1:
        raise TypeError("encoding torch tensors on a big-endian host is not supported")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    flat = tensor.reshape(-1).view(torch.uint8)
    return EXT_TORCH, _payload(_header(name, tuple(tensor.shape)), memoryview(flat.numpy()))


_DTYPE_BY_NAME_BYTES: dict[bytes, str] = {name.encode("ascii"): name for name in WIRE_DTYPES}


def decode_tensor(code: int, data: memoryview, max_tensor_bytes: int) -> Any:
    """Parse an ext payload into a numpy view or a torch tensor; raise TensorFormatError if malformed."""
    size = len(data)
    if size < 2:
        raise TensorFormatError(f"ext payload of {size} bytes is shorter than a tensor header")
    dtype_len = data[0]
    if 2 + dtype_len > size:
        raise TensorFormatError("tensor header truncated inside the dtype name")
    dtype = _DTYPE_BY_NAME_BYTES.get(data[1 : 1 + dtype_len].tobytes())
    if dtype is None:
        raise TensorFormatError(
            f"unknown tensor dtype {data[1 : 1 + dtype_len].tobytes()!r}; supported: {', '.join(WIRE_DTYPES)}"
        )
    ndim = data[1 + dtype_len]
    if ndim > MAX_NDIM:
        raise TensorFormatError(f"tensor has {ndim} dimensions (max {MAX_NDIM})")
    offset = 2 + dtype_len + 8 * ndim
    if offset > size:
        raise TensorFormatError("tensor header truncated inside the shape")
    if ndim == 1:
        shape: tuple[int, ...] = _DIM.unpack_from(data, 2 + dtype_len)
        count = shape[0]
    else:
        shape = struct.unpack_from(f"<{ndim}Q", data, 2 + dtype_len)
        count = 1
        for dim in shape:
            count *= dim
    nbytes = size - offset
    if count * ITEMSIZE[dtype] != nbytes:
        raise TensorFormatError(
            f"{dtype} tensor of shape {list(shape)} needs {count * ITEMSIZE[dtype]} bytes, payload has {nbytes}"
        )
    if nbytes > max_tensor_bytes:
        raise TensorTooLarge(f"tensor of {nbytes} bytes exceeds max_tensor_bytes={max_tensor_bytes}")
    if dtype == "bool" and nbytes and np.frombuffer(data, dtype=np.uint8, offset=offset).max() > 1:
        raise TensorFormatError("bool tensor holds bytes other than 0 and 1")
    if code == EXT_NDARRAY:
        return _numpy_view(dtype, shape, data, offset, count)
    return _torch_view(dtype, shape, data, offset, count)


def _numpy_view(dtype: str, shape: tuple[int, ...], data: memoryview, offset: int, count: int) -> np.ndarray:
    if dtype not in NUMPY_DTYPES:
        raise TensorFormatError(f"numpy has no {dtype}; send it as a torch tensor (ext type {EXT_TORCH})")
    if count == 0:
        array = np.empty(shape, dtype=NUMPY_DTYPES[dtype])
    else:
        array = np.frombuffer(data, dtype=NUMPY_DTYPES[dtype], count=count, offset=offset)
        if len(shape) != 1:
            array = array.reshape(shape)
    array.flags.writeable = False  # a view of the frame, even when the frame itself is a writable buffer
    return array


def _torch_view(dtype: str, shape: tuple[int, ...], data: memoryview, offset: int, count: int) -> torch.Tensor:
    try:
        import torch
    except ImportError:
        raise TensorFormatError("received a torch tensor but torch is not installed here") from None
    torch_dtype = getattr(torch, dtype)
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    view = data[offset:]
    aligned = np.frombuffer(view, dtype=np.uint8).ctypes.data % ITEMSIZE[dtype] == 0
    with warnings.catch_warnings():
        # The frame is read-only and torch cannot mark tensors read-only: documented above.
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(view if aligned else bytearray(view), dtype=torch_dtype, count=count)
    return tensor.reshape(shape)
