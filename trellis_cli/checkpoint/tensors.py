"""Lazy tensor reads: one tensor (or a run of its leading-dimension rows) by a bounded byte read.

Reads go through `source.local_path(file)` and read exactly the bytes of the requested range, checked against
the file's size first, so a truncated or corrupt shard gives a named error and other tensors of the same shard
stay readable. A whole shard is never loaded or mapped.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from trellis_cli.checkpoint.model import Checkpoint, TensorRef
from trellis_cli.errors import CheckFailed
from trellis_cli.header_records import DTYPE_BYTES

if TYPE_CHECKING:
    import torch

_TORCH_DTYPES = {
    "I16": "int16", "F16": "float16", "I32": "int32", "F32": "float32", "BF16": "bfloat16", "I64": "int64",
    "F64": "float64", "U8": "uint8", "I8": "int8", "BOOL": "bool", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}


def read_tensor(checkpoint: Checkpoint, ref: TensorRef) -> "torch.Tensor":
    """The whole tensor `ref` as a CPU tensor of its stored dtype and shape."""
    rows = ref.shape[0] if ref.shape else 1
    return read_rows(checkpoint, ref, 0, rows) if ref.shape else _read(checkpoint, ref, 0, ref.nbytes, ())


def read_rows(checkpoint: Checkpoint, ref: TensorRef, start: int, stop: int) -> "torch.Tensor":
    """Rows [start, stop) of the leading dimension (e.g. a few tile rows of a trellis), shape kept otherwise."""
    if not ref.shape:
        raise CheckFailed(f"{ref.file}: {ref.name}: a 0-dim tensor has no rows to slice")
    if not 0 <= start <= stop <= ref.shape[0]:
        raise CheckFailed(f"{ref.file}: {ref.name}: rows [{start}, {stop}) outside [0, {ref.shape[0]})")
    row_bytes = math.prod(ref.shape[1:]) * _itemsize(ref)
    expected = ref.shape[0] * row_bytes
    if ref.nbytes != expected:
        raise CheckFailed(f"{ref.file}: {ref.name}: byte range holds {ref.nbytes} bytes, "
                          f"expected {expected} for {ref.dtype} {list(ref.shape)}")
    return _read(checkpoint, ref, start * row_bytes, (stop - start) * row_bytes, (stop - start, *ref.shape[1:]))


def read_bytes(checkpoint: Checkpoint, ref: TensorRef, offset: int, length: int) -> bytes:
    """`length` stored bytes of a tensor from byte `offset` of its data (e.g. the padding tail of one row)."""
    if not 0 <= offset <= offset + length <= ref.nbytes:
        raise CheckFailed(f"{ref.file}: {ref.name}: bytes [{offset}, {offset + length}) outside its {ref.nbytes}")
    return bytes(_read(checkpoint, ref._replace(dtype="U8"), offset, length, (length,)).numpy())


def _itemsize(ref: TensorRef) -> int:
    if ref.dtype not in DTYPE_BYTES or ref.dtype not in _TORCH_DTYPES:
        raise CheckFailed(f"{ref.file}: {ref.name}: dtype {ref.dtype} cannot be read")
    return DTYPE_BYTES[ref.dtype]


def _read(checkpoint: Checkpoint, ref: TensorRef, offset: int, length: int, shape: tuple[int, ...]) -> "torch.Tensor":
    import torch

    itemsize = _itemsize(ref)
    if not shape and ref.nbytes != itemsize:
        raise CheckFailed(f"{ref.file}: {ref.name}: 0-dim tensor holds {ref.nbytes} bytes, expected {itemsize}")
    path = checkpoint.source.local_path(ref.file)
    begin = ref.absolute_range[0] + offset
    try:
        size = os.path.getsize(path)
        if begin + length > size:
            raise CheckFailed(f"{ref.file}: {ref.name}: bytes [{begin}, {begin + length}) run past the end of "
                              f"the {size}-byte file")
        with open(path, "rb") as f:
            f.seek(begin)
            data = f.read(length)
    except OSError as e:
        raise CheckFailed(f"{ref.file}: cannot read {ref.name} ({e.strerror or e})") from e
    if len(data) != length:
        raise CheckFailed(f"{ref.file}: {ref.name}: short read, expected {length} bytes, got {len(data)}")
    dtype = getattr(torch, _TORCH_DTYPES[ref.dtype])
    if length == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
