"""A streaming safetensors writer: header first, then tensors one at a time, holes allowed.

`safetensors.torch.save_file` needs every tensor in memory at once and truncates its target in place;
checkpoints here are written layer by layer (synth) or slab by slab (repack), so this writer plans the
whole header up front, then accepts tensor data in header order. A tensor can be `skip`ped: its region is
left unwritten (a hole that reads as zeros), so real headers over unwritten data give header-level work at
production size in seconds. Files are written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from trellis_cli.header import DTYPE_BYTES

if TYPE_CHECKING:
    import torch

TORCH_TO_ST = {
    "torch.int16": "I16", "torch.float16": "F16", "torch.int32": "I32", "torch.float32": "F32",
    "torch.bfloat16": "BF16", "torch.int64": "I64", "torch.uint8": "U8", "torch.int8": "I8",
    "torch.float64": "F64", "torch.bool": "BOOL",
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


def encode_header(tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the JSON header, padded with spaces to a multiple of 8 bytes."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


class SafetensorsWriter:
    """Write one safetensors file whose tensors arrive in header order. Use as a context manager."""

    def __init__(self, path: str | Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.tensors = tensors
        self._holes = False
        self._next = 0
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._header = encode_header(tensors, metadata)
        self.data_bytes = sum(t.nbytes for t in tensors)
        self._file = open(self._tmp, "wb")
        self._file.write(self._header)

    @property
    def file_size(self) -> int:
        return len(self._header) + self.data_bytes

    def _expect(self, name: str) -> PlannedTensor:
        if self._next >= len(self.tensors) or self.tensors[self._next].name != name:
            expected = self.tensors[self._next].name if self._next < len(self.tensors) else "no more tensors"
            raise ValueError(f"{self.path.name}: tensor {name!r} written out of order (expected {expected})")
        return self.tensors[self._next]

    def write(self, name: str, data: "torch.Tensor | bytes | memoryview") -> None:
        """Append the next tensor's bytes; `name` must be the next planned tensor."""
        planned_tensor = self._expect(name)
        if not isinstance(data, (bytes, memoryview)):
            data = memoryview(data.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy())
        if len(data) != planned_tensor.nbytes:
            raise ValueError(f"{self.path.name}: {name}: {len(data)} bytes, planned {planned_tensor.nbytes}")
        self._file.write(data)
        self._next += 1

    def write_parts(self, name: str, parts: "Iterable[bytes | memoryview]") -> None:
        """Append the next tensor's bytes from consecutive pieces (a large tensor is never whole in memory)."""
        planned_tensor = self._expect(name)
        total = 0
        for part in parts:
            total += len(part)
            if total > planned_tensor.nbytes:
                break
            self._file.write(part)
        if total != planned_tensor.nbytes:
            raise ValueError(f"{self.path.name}: {name}: {total} bytes or more, planned {planned_tensor.nbytes}")
        self._next += 1

    def skip(self, name: str) -> None:
        """Leave the next tensor unwritten (a hole that reads as zeros)."""
        self._file.seek(self._expect(name).nbytes, os.SEEK_CUR)
        self._holes = True
        self._next += 1

    def finish(self) -> Path:
        if self._next != len(self.tensors):
            raise ValueError(f"{self.path.name}: {len(self.tensors) - self._next} planned tensors never written")
        if self._holes:  # a skipped last tensor leaves the file short of its planned size
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

    def __exit__(self, exc_type, exc, tb) -> None:
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

