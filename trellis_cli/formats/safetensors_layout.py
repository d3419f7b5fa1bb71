"""The byte layout every safetensors shard must have, from its header and its size alone.

file size == 8 + header length + data end; every byte range inside the data buffer; no overlaps and no holes
(the format forbids unindexed bytes); dtype x shape == byte length. Shared by the checkpoint rules
(validate/rules_files.py) and the route-pack verification (dialects/routepack/verify.py).
"""

from __future__ import annotations

from operator import attrgetter, sub
from typing import Iterator, NamedTuple

from trellis_cli.findings import Finding, Location, error
from trellis_cli.header_records import nbytes_of


class Layout(NamedTuple):
    sound: bool  # the tensors tile the data buffer in stored order (`shard_layout`)
    data_end: int  # the end of the last tensor's bytes


def shard_layout(header) -> Layout:
    """Whether the shard is sound in stored order, and its data end (the last end when it is: no second pass)."""
    end = _sound_end(header)
    return Layout(True, end) if end is not None else Layout(False, header.data_end)


def check_shard(file: str, header, layout: Layout | None = None) -> Iterator[Finding]:
    """Byte layout of one shard, from its header and its size (`layout`: `shard_layout(header)`, when the caller
    has it already)."""
    sound, data_end = layout if layout is not None else shard_layout(header)
    entries = [] if sound else sorted(header.tensors.values(), key=lambda e: (e.begin, e.end))
    if header.file_size is not None:
        expected_size = header.data_start + data_end
        if header.file_size < expected_size:
            yield error("file.truncated", Location(file=file), "file ends before the data its header declares",
                        expected=f"{expected_size} bytes", found=f"{header.file_size} bytes")
        elif header.file_size > expected_size:
            yield error("file.trailing-bytes", Location(file=file), "bytes after the last tensor (not covered by "
                        "the header)", expected=f"{expected_size} bytes", found=f"{header.file_size} bytes")
    cursor, previous = 0, None
    for e in entries:
        expected = e.expected_nbytes
        if e.end - e.begin != expected:
            yield error("tensor.nbytes", Location(file=file, tensor=e.name), "byte range does not match dtype x shape",
                        expected=f"{expected} bytes ({e.dtype} {list(e.shape)})", found=f"{e.end - e.begin} bytes")
        if e.begin < cursor:
            yield error("file.overlap", Location(file=file, tensor=e.name), f"byte range overlaps {previous}",
                        expected=f"begin >= {cursor}", found=f"[{e.begin}, {e.end})")
        elif e.begin > cursor:
            yield error("file.hole", Location(file=file, tensor=e.name), "unindexed bytes before this tensor",
                        expected=f"begin {cursor}", found=f"begin {e.begin}")
        if header.file_size is not None and header.data_start + e.end > header.file_size:
            yield error("file.offset-range", Location(file=file, tensor=e.name), "byte range runs past the end "
                        "of the file", expected=f"end <= {header.file_size - header.data_start}", found=e.end)
        if e.end > cursor:
            cursor, previous = e.end, e.name


_BEGIN, _END, _DTYPE, _SHAPE = attrgetter("begin"), attrgetter("end"), attrgetter("dtype"), attrgetter("shape")


def _sound_end(header) -> int | None:
    """The data end when the tensors, in the header's own order, tile the data buffer from 0 with no gap or
    overlap, each of its dtype x shape and inside the file: then sorting changes nothing and the per-tensor checks
    find nothing. Taken from the header where its columns proved the tiling as they were read
    (`Entries.tiled_end`), else proven with list comparisons in C (a production shard has 12k tensors); None sends
    the shard to the per-tensor walk, which names what is wrong."""
    proven = header.tensors.tiled_end
    if proven is not None:
        return None if header.file_size is not None and header.data_start + proven > header.file_size else proven
    entries = list(header.tensors.values())
    if not entries:
        return None
    begins, ends = list(map(_BEGIN, entries)), list(map(_END, entries))
    if begins[0] != 0 or begins[1:] != ends[:-1]:
        return None
    if header.file_size is not None and header.data_start + ends[-1] > header.file_size:
        return None
    # each (dtype, shape) pair is made, looked up and dropped in one stream (no list of them, no set)
    sizes = list(map(_Sizes().__getitem__, zip(map(_DTYPE, entries), map(_SHAPE, entries))))
    return ends[-1] if list(map(sub, ends, begins)) == sizes else None


class _Sizes(dict):
    """(dtype, shape) -> the bytes dtype x shape holds, each computed the first time it is asked for."""

    def __missing__(self, kind: tuple[str, tuple[int, ...]]) -> int:
        size = self[kind] = nbytes_of(*kind)
        return size
