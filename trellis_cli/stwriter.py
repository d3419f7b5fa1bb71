"""A streaming safetensors writer: a canonical header first, then tensors one at a time, holes allowed.

`safetensors.torch.save_file` needs every tensor in memory at once and truncates its target in place;
checkpoints here are written layer by layer (synth) or slab by slab (repack), so this writer plans the
whole header up front, then accepts tensor data in any order, each at its planned offset. The header is
canonical: laid out as safetensors' own writer does (by dtype, then by name; compact JSON, UTF-8, padded
with spaces), so a file that writer made is reproduced byte for byte when its tensors are written again. A
tensor can be `skip`ped: its region is left unwritten (a hole that reads as zeros), so real headers over
unwritten data give header-level work at production size in seconds. Files are written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Iterable

from trellis_cli.header_records import DTYPE_BYTES

if TYPE_CHECKING:
    import torch

TORCH_TO_ST = {
    "torch.int16": "I16", "torch.float16": "F16", "torch.int32": "I32", "torch.float32": "F32",
    "torch.bfloat16": "BF16", "torch.int64": "I64", "torch.uint8": "U8", "torch.int8": "I8",
    "torch.float64": "F64", "torch.bool": "BOOL", "torch.uint16": "U16", "torch.uint32": "U32",
    "torch.uint64": "U64", "torch.float8_e5m2": "F8_E5M2", "torch.float8_e4m3fn": "F8_E4M3",
}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @cached_property  # asked several times per tensor; a production run plans ~930k tensors
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def planned(name: str, tensor: "torch.Tensor") -> PlannedTensor:
    return PlannedTensor(name, TORCH_TO_ST[str(tensor.dtype)], tuple(tensor.shape))


# safetensors' writer orders tensors by dtype, last of this list first, then by name (byte order).
DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32",
               "F32", "F64", "I64", "U64")
_DTYPE_RANK = {dtype: rank for rank, dtype in enumerate(DTYPE_ORDER)}


def canonical_order(tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """The tensors in the order safetensors lays them out."""
    return sorted(tensors, key=lambda t: (-_DTYPE_RANK.get(t.dtype, -1), t.name))


def encode_header(tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the JSON header, padded with spaces to a multiple of 8 bytes; data
    offsets follow the order of `tensors` (SafetensorsWriter passes the canonical order)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


class SafetensorsWriter:
    """Write one safetensors file with a canonical header; tensors may arrive in any order. Use as a
    context manager."""

    def __init__(self, path: str | Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.tensors = canonical_order(tensors)
        self._header = encode_header(self.tensors, metadata)
        self._offsets: dict[str, tuple[int, PlannedTensor]] = {}
        offset = len(self._header)
        for t in self.tensors:
            self._offsets[t.name] = (offset, t)
            offset += t.nbytes
        self._written: set[str] = set()
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self.data_bytes = sum(t.nbytes for t in tensors)
        self._file = open(self._tmp, "wb")
        self._file.write(self._header)

    @property
    def file_size(self) -> int:
        return len(self._header) + self.data_bytes

    def _claim(self, name: str) -> tuple[int, PlannedTensor]:
        """The planned tensor `name` (offset, plan); each is written or skipped exactly once."""
        if name not in self._offsets or name in self._written:
            what = "written twice" if name in self._written else "not planned"
            raise ValueError(f"{self.path.name}: tensor {name!r} {what}")
        return self._offsets[name]

    def _seek(self, offset: int) -> None:
        if self._file.tell() != offset:  # in canonical order the writes stay sequential
            self._file.seek(offset)

    def write(self, name: str, data: "torch.Tensor | bytes | memoryview") -> None:
        """Write one planned tensor's bytes at its offset."""
        offset, planned_tensor = self._claim(name)
        if not isinstance(data, (bytes, memoryview)):
            data = data.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().data
        if len(data) != planned_tensor.nbytes:
            raise ValueError(f"{self.path.name}: {name}: {len(data)} bytes, planned {planned_tensor.nbytes}")
        self._seek(offset)
        self._file.write(data)
        self._written.add(name)

    def write_parts(self, name: str, parts: "Iterable[bytes | memoryview]") -> None:
        """Write one planned tensor from consecutive pieces (a large tensor is never whole in memory)."""
        offset, planned_tensor = self._claim(name)
        self._seek(offset)
        total = 0
        for part in parts:
            total += len(part)
            if total > planned_tensor.nbytes:
                break
            self._file.write(part)
        if total != planned_tensor.nbytes:
            raise ValueError(f"{self.path.name}: {name}: {total} bytes or more, planned {planned_tensor.nbytes}")
        self._written.add(name)

    def skip(self, name: str) -> None:
        """Leave one planned tensor unwritten (a hole that reads as zeros)."""
        self._claim(name)
        self._written.add(name)

    def finish(self) -> Path:
        if len(self._written) != len(self.tensors):
            raise ValueError(f"{self.path.name}: {len(self.tensors) - len(self._written)} planned tensors never "
                             "written")
        if self._file.tell() != self.file_size:  # a hole or an early write at the end
            self._file.truncate(self.file_size)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is None:
                self.finish()
                return
            self.abort()
        except OSError as e:
            exc = e
            raise
        finally:
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = str(self.path)  # a failed write() or fsync() names no file

