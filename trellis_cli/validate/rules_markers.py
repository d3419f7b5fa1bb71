"""Codebook marker values, read by default: every rank-sliced loader reads the 4-byte `.mcg` / `.mul1` scalars
at load and refuses a wrong one, so a header-only verdict would pass what they refuse.

The reads are batched: per shard one open, markers in file order, and markers close together (the layout
puts each one right after its linear's vectors) read as one span. A production checkpoint has ~230k markers;
this stays a few seconds of small reads. Remote sources are not downloaded for this: their markers are read
with --deep (which fetches the chosen layers' shards), and the report says when they were not read.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Iterable, Iterator

import numpy as np

from trellis_cli.checkpoint.model import Checkpoint, TensorRef
from trellis_cli.codebooks import MARKERS
from trellis_cli.findings import Finding, Location, Severity, error

# marker tensor suffix -> the int32 it must hold (codebooks.py: the codebooks that have a marker)
MARKER_VALUES = {marker[0]: marker[1] for marker in MARKERS.values() if marker is not None}
MARKER_BYTES = 4
SPAN_GAP = 64 * 1024  # markers closer than this are read in one span
SPAN_MAX = 4 * 1024 * 1024  # but no span longer than this (bounded memory)


def layer_markers(ckpt: Checkpoint, layers: Iterable[int]) -> Iterator[tuple[TensorRef, str, tuple]]:
    """(marker, kind, (layer, expert, projection, rank)) for every well-formed marker of the chosen layers
    (malformed ones are header findings already)."""
    for li in layers:
        for expert, projs in ckpt.layers[li].experts.items():
            for proj, by_rank in projs.items():
                for rank, lin in by_rank.items():
                    for kind, ref in (("mcg", lin.mcg), ("mul1", lin.mul1)):
                        if ref is not None and (ref.dtype, ref.shape, ref.nbytes) == ("I32", (), MARKER_BYTES):
                            yield ref, kind, (li, expert, proj, rank)


def check_marker_values(ckpt: Checkpoint, layers: Iterable[int], count) -> Iterator[Finding]:
    by_file: dict[str, list[tuple[TensorRef, str, tuple]]] = defaultdict(list)
    for item in layer_markers(ckpt, layers):
        by_file[item[0].file].append(item)
    for file, items in sorted(by_file.items()):
        refs = [ref for ref, _, _ in items]
        read = _read_marker_array(ckpt, file, refs)
        if read is None:  # offsets numpy cannot hold: the per-marker reader
            values, problem = _read_scalars(ckpt, file, refs)
            wrong: Iterable[tuple[int, int]] = ((i, values[ref.name]) for i, ref in enumerate(refs)
                                                if ref.name in values and values[ref.name] != MARKER_VALUES[items[i][1]])
            nread = len(values)
        else:
            array, done, problem = read
            expected = np.fromiter((MARKER_VALUES[kind] for _, kind, _ in items), dtype=np.int64, count=len(items))
            wrong = ((int(i), int(array[i])) for i in np.flatnonzero(done & (array != expected)))
            nread = int(done.sum())
        if problem is not None:
            yield problem
        count("markers read", nread)
        for i, value in wrong:  # only the markers that hold another value are looked at one by one
            ref, kind, (li, expert, proj, rank) = items[i]
            where = Location(layer=li, expert=expert, projection=proj, rank=rank, tensor=ref.name)
            yield error("marker.value", where, f".{kind} marker holds the wrong value (the loaders refuse it)",
                        expected=hex(MARKER_VALUES[kind] & 0xFFFFFFFF), found=hex(value & 0xFFFFFFFF))


def _read_marker_array(ckpt: Checkpoint, file: str, refs: list[TensorRef]) -> tuple[Any, Any, Finding | None] | None:
    """`_read_scalars` with arrays: (value per ref, whether it was read, the problem), the same spans read in
    the same order, each span's values gathered at once (a production shard has ~3k markers). None when an
    offset does not fit an int64 (a header only the per-marker reader may take)."""
    try:
        offsets = np.fromiter((ref.data_start + ref.begin for ref in refs), dtype=np.int64, count=len(refs))
    except OverflowError:
        return None
    if len(offsets) and int(offsets.max()) > 1 << 62:  # far past any file: no room for int64 arithmetic on it
        return None
    values = np.zeros(len(refs), dtype=np.int64)
    done = np.zeros(len(refs), dtype=bool)
    try:
        path = ckpt.source.local_path(file)
        size = os.path.getsize(path)
        order = np.argsort(offsets, kind="stable")
        order = order[offsets[order] + MARKER_BYTES <= size]
        starts = offsets[order]
        with open(path, "rb") as f:
            for lo, hi in _array_spans(starts):
                begin = int(starts[lo])
                f.seek(begin)
                data = f.read(int(starts[hi - 1]) + MARKER_BYTES - begin)
                rel = starts[lo:hi] - begin
                whole = rel + MARKER_BYTES <= len(data)
                at = rel[whole]
                raw = np.frombuffer(data, dtype=np.uint8)[at[:, None] + np.arange(MARKER_BYTES)]
                chosen = order[lo:hi][whole]
                values[chosen] = np.ascontiguousarray(raw).view("<i4").ravel()
                done[chosen] = True
    except OSError as e:
        return values, done, error("data.unreadable", Location(file=file), f"cannot read the codebook markers "
                                   f"({e.strerror or e})")
    missing = len(refs) - int(done.sum())
    if missing:
        return values, done, error("data.unreadable", Location(file=file), "codebook markers lie past the end of "
                                   "the file", expected=f"{len(refs)} markers readable", found=f"{missing} unreadable")
    return values, done, None


def _array_spans(starts: Any) -> Iterator[tuple[int, int]]:
    """`_spans` over sorted offsets, as [lo, hi) index ranges: one Python step per span, not per marker."""
    n = len(starts)
    gaps = np.flatnonzero(np.diff(starts) > SPAN_GAP) + 1  # a span never crosses one of these
    lo = 0
    for stop in [*gaps.tolist(), n]:
        while lo < stop:
            hi = min(stop, int(np.searchsorted(starts, starts[lo] + SPAN_MAX, side="right")))
            yield lo, hi
            lo = hi


def not_read_finding() -> Finding:
    return Finding("marker.not-read", Severity.INFO, Location(), "codebook marker values were not read (a remote "
                   "source is not downloaded by default): loaders refuse a wrong one at load; --deep reads them")


def _read_scalars(ckpt: Checkpoint, file: str, refs: list[TensorRef]) -> tuple[dict[str, int], Finding | None]:
    """The int32 value of each 4-byte tensor of one shard; markers past the end of the file are left out."""
    values: dict[str, int] = {}
    try:
        path = ckpt.source.local_path(file)
        size = os.path.getsize(path)
        starts = sorted((ref.data_start + ref.begin, ref.name) for ref in refs)
        inside = [(begin, name) for begin, name in starts if begin + MARKER_BYTES <= size]
        with open(path, "rb") as f:
            for span in _spans(inside):
                begin = span[0][0]
                f.seek(begin)
                data = f.read(span[-1][0] + MARKER_BYTES - begin)
                for at, name in span:
                    chunk = data[at - begin:at - begin + MARKER_BYTES]
                    if len(chunk) == MARKER_BYTES:
                        values[name] = int.from_bytes(chunk, "little", signed=True)
    except OSError as e:
        return values, error("data.unreadable", Location(file=file), f"cannot read the codebook markers "
                             f"({e.strerror or e})")
    missing = len(refs) - len(values)
    if missing:
        return values, error("data.unreadable", Location(file=file), "codebook markers lie past the end of the file",
                             expected=f"{len(refs)} markers readable", found=f"{missing} unreadable")
    return values, None


def _spans(starts: list[tuple[int, str]]) -> Iterator[list[tuple[int, str]]]:
    """Runs of (offset, name), in file order, close enough to be read at once."""
    span: list[tuple[int, str]] = []
    for item in starts:
        if span and (item[0] - span[-1][0] > SPAN_GAP or item[0] - span[0][0] > SPAN_MAX):
            yield span
            span = []
        span.append(item)
    if span:
        yield span
