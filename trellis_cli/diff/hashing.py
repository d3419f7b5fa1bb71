"""Content identity of units, cheapest first.

1. Storage: two units at the same byte range of files the sources say hold the same bytes are identical with
   nothing read. On the Hub that is the LFS sha256 of each file (`lfs-sha256`, listed by the Hub, no download);
   locally, the same file (`same-file`: one inode, e.g. a hard-linked copy).
2. Otherwise a streamed sha256 of each unit's bytes (`sha256`): files are read in 1 MiB pieces, each file
   opened once, units in file order. A range the file system reports as a hole holds zeros, so its digest is
   that of zeros of its length (computed once per length) without reading it: a sparse production-size
   checkpoint hashes in seconds. Memory is bounded by one piece, whatever the tensor size.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from trellis_cli.diff.units import Span
from trellis_cli.errors import CheckFailed
from trellis_cli.header import open_regular, os_reason
from trellis_cli.sources import Source

LFS = "lfs-sha256"
SAME_FILE = "same-file"
SHA256 = "sha256"
HEADER = "header"  # decided from the headers: present in one side only, or another dtype or shape
READ_BYTES = 1 << 20
PROGRESS_BYTES = 64 << 20  # progress is reported in pieces of this size (a call per unit would cost more than the hole)

Progress = Callable[[int], None]


def storage_identity(source: Source, file: str, cache: dict[str, tuple | None]) -> tuple | None:
    """(method, what identifies the file's bytes), or None when the source cannot say without reading."""
    if file in cache:
        return cache[file]
    found: tuple | None = None
    if source.root is None:  # a remote source: the listing carries each LFS file's sha256
        info = source.file_info(file)
        sha = info.lfs_sha256 if info is not None else None
        found = (LFS, sha) if sha else None
    else:  # a local one: the file itself, wherever its links lead
        try:
            st = os.stat(source.local_path(file))
            found = (SAME_FILE, st.st_dev, st.st_ino)
        except (OSError, CheckFailed):
            found = None
    cache[file] = found
    return found


class Hasher:
    """sha256 of spans of one source's files; each file opened once and downloaded first when remote."""

    def __init__(self, source: Source, progress: Progress | None = None,
                 download_progress: Progress | None = None) -> None:
        self.source = source
        self.progress = progress
        self.download_progress = download_progress
        self._zero: dict[int, str] = {}
        self._last: dict[Span, str] = {}
        self._paths: dict[str, Path] = {}

    def digests(self, spans: Iterable[Span]) -> dict[Span, str]:
        """sha256 of each span. The last call's are kept and not read again: a diff that hashed a layer's spans
        in bulk and then goes unit by unit to name what differs asks for them twice."""
        wanted = set(spans)
        out = {span: self._last[span] for span in wanted & self._last.keys()}
        by_file: dict[str, list[Span]] = {}
        for span in wanted - out.keys():
            by_file.setdefault(span.file, []).append(span)
        for file in sorted(by_file):
            out.update(self._file_digests(file, sorted(by_file[file], key=lambda s: s.begin)))
        self._last = out
        return out

    def holes(self, file: str, begins: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
        """Which spans [begin, end) of one file lie wholly in holes (read as zeros, hashed as `zero_digest`), from
        its data extents; None when a span runs past the end of the file (`digests` refuses it by name)."""
        try:
            with open_regular(self._path(file)) as f:
                size = os.fstat(f.fileno()).st_size
                extents = data_extents(f.fileno(), size)
        except OSError as e:
            raise CheckFailed(f"{file}: cannot be read ({os_reason(e)})") from e
        if ends.size and int(ends.max()) > size:
            return None
        if not extents:
            return np.ones(begins.size, dtype=bool)
        starts = np.array([begin for begin, _ in extents], dtype=np.int64)
        stops = np.array([end for _, end in extents], dtype=np.int64)
        # the last extent starting before a span's end decides: does it reach into the span?
        last = np.searchsorted(starts, ends, side="left") - 1
        reach = np.where(last >= 0, stops[np.maximum(last, 0)], 0)
        hole: np.ndarray = (last < 0) | (reach <= begins)
        return hole

    def advance(self, nbytes: int) -> None:
        """Report `nbytes` decided without reading them (holes on both sides), as `digests` reports what it hashes."""
        if self.progress is not None and nbytes:
            self.progress(nbytes)

    def _file_digests(self, file: str, spans: list[Span]) -> dict[Span, str]:
        try:
            with open_regular(self._path(file)) as f:
                fd = f.fileno()
                size = os.fstat(fd).st_size
                extents = data_extents(fd, size)
                starts = [begin for begin, _ in extents]
                out, done = {}, 0
                for span in spans:
                    if span.end > size:
                        raise CheckFailed(f"{file}: bytes [{span.begin}, {span.end}) run past the end of the "
                                          f"{size}-byte file")
                    # the last extent starting before span.end decides: does it reach into the span?
                    i = bisect.bisect_left(starts, span.end) - 1
                    hole = i < 0 or extents[i][1] <= span.begin
                    out[span] = self.zero_digest(span.end - span.begin) if hole else self._digest(fd, file, span)
                    done += span.end - span.begin
                    if self.progress is not None and done >= PROGRESS_BYTES:
                        self.progress(done)
                        done = 0
                if self.progress is not None and done:
                    self.progress(done)
                return out
        except OSError as e:
            raise CheckFailed(f"{file}: cannot be read ({os_reason(e)})") from e

    def _path(self, file: str) -> Path:
        """The file's local path, resolved (or downloaded) once: a layer asks for its holes, then its digests."""
        found = self._paths.get(file)
        if found is None:
            found = self._paths[file] = self.source.local_path(file, progress=self.download_progress)
        return found

    def _digest(self, fd: int, file: str, span: Span) -> str:
        h = hashlib.sha256()
        left = span.end - span.begin
        while left:
            piece = os.pread(fd, min(READ_BYTES, left), span.end - left)
            if not piece:
                raise CheckFailed(f"{file}: short read at byte {span.end - left}")
            h.update(piece)
            left -= len(piece)
        return h.hexdigest()

    def zero_digest(self, length: int) -> str:
        if length not in self._zero:
            h, zeros = hashlib.sha256(), bytes(min(length, READ_BYTES))
            left = length
            while left:
                h.update(zeros[:min(left, len(zeros))])
                left -= min(left, len(zeros))
            self._zero[length] = h.hexdigest()
        return self._zero[length]


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The file's data extents [(begin, end)] in order, as the file system reports them (SEEK_DATA/SEEK_HOLE);
    the whole file when it cannot say. Everything outside them reads as zeros."""
    if not hasattr(os, "SEEK_DATA"):
        return [(0, size)]
    extents, position = [], 0
    try:
        while position < size:
            try:
                begin = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data after position: a hole to the end
                    break
                raise
            end = os.lseek(fd, begin, os.SEEK_HOLE)
            extents.append((begin, end))
            position = end
    except OSError:
        return [(0, size)]
    return extents
