"""A bounded, fail-closed parser for safetensors headers.

Used for local files and for header bytes fetched from the Hub alike, so both get the same checks.
The rules follow the safetensors format: u64 little-endian header length N, N bytes of UTF-8 JSON object,
then the data buffer; `data_offsets` are [begin, end) relative to the buffer start.
Structural problems that make the header unusable raise HeaderError; problems between entries
(overlaps, holes, size mismatches) are left to validate, which reports them as findings.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

# The Hub's own parser refuses headers above 25 MB; the safetensors reader above 100 MB. A production
# MoE layer shard (12,288 tensors) has a header of about 1.5 MB.
MAX_HEADER_BYTES = 100_000_000

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


class HeaderError(ValueError):
    """The header cannot be parsed; the message says what was expected and what was found."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def expected_nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 0)


@dataclass(frozen=True)
class Header:
    file: str  # path relative to the checkpoint root
    header_len: int  # N
    file_size: int | None  # None when unknown (never for local files)
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_end(self) -> int:
        return max((t.end for t in self.tensors.values()), default=0)


def header_length(prefix: bytes, file: str, file_size: int | None) -> int:
    """Decode N from the first 8 bytes and check its bounds."""
    if len(prefix) < 8:
        raise HeaderError(f"{file}: file is {len(prefix)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n == 0 or n > MAX_HEADER_BYTES:
        raise HeaderError(f"{file}: header length {n} is outside 1..{MAX_HEADER_BYTES}")
    if file_size is not None and 8 + n > file_size:
        raise HeaderError(f"{file}: header length {n} runs past the end of the {file_size}-byte file")
    return n


def parse_header(file: str, header_bytes: bytes, header_len: int, file_size: int | None) -> Header:
    """Parse the JSON header (the N bytes after the length prefix)."""
    if len(header_bytes) != header_len:
        raise HeaderError(f"{file}: header truncated: expected {header_len} bytes, read {len(header_bytes)}")
    try:
        raw = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except UnicodeDecodeError as e:
        raise HeaderError(f"{file}: header is not UTF-8 ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise HeaderError(f"{file}: header is not valid JSON ({e.msg} at byte {e.pos})") from e
    except ValueError as e:  # duplicate key
        raise HeaderError(f"{file}: {e}") from e
    if not isinstance(raw, dict):
        raise HeaderError(f"{file}: header is a JSON {type(raw).__name__}, expected an object")
    metadata = raw.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderError(f"{file}: __metadata__ must map strings to strings")
    tensors = {name: _parse_entry(file, name, info) for name, info in raw.items()}
    return Header(file=file, header_len=header_len, file_size=file_size, tensors=tensors, metadata=metadata)


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):  # the cheap test first: a production header has ~12k entries per shard
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"duplicate key {duplicate!r} in header")
    return out


def is_int(value: object) -> bool:
    """A JSON integer: True for 3, False for 3.0 and for `true` (bool is an int subclass in Python)."""
    return type(value) is int


def _parse_entry(file: str, name: str, info: object) -> TensorEntry:
    if not isinstance(info, dict):
        raise HeaderError(f"{file}: {name}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise HeaderError(f"{file}: {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise HeaderError(f"{file}: {name}: shape must be a list of non-negative integers, found {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(f"{file}: {name}: data_offsets must be [begin, end] with 0 <= begin <= end, found {offsets!r}")
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])


def read_local_header(path, rel_name: str) -> Header:
    """Read and parse the header of a local file, reading only the header bytes."""
    import os

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = header_length(f.read(8), rel_name, size)
        return parse_header(rel_name, f.read(n), n, size)
