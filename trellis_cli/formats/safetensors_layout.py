"""The byte layout every safetensors shard must have, from its header and its size alone.

file size == 8 + header length + data end; every byte range inside the data buffer; no overlaps and no holes
(the format forbids unindexed bytes); dtype x shape == byte length. Shared by the checkpoint rules
(validate/rules_files.py) and the route-pack verification (dialects/routepack/verify.py).
"""

from __future__ import annotations

import math
from typing import Iterator

from trellis_cli.findings import Finding, Location, error
from trellis_cli.header import DTYPE_BYTES


def check_shard(file: str, header) -> Iterator[Finding]:
    """Byte layout of one shard, from its header and its size."""
    entries = sorted(header.tensors.values(), key=lambda e: (e.begin, e.end))
    data_end = header.data_end
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
        expected = math.prod(e.shape) * DTYPE_BYTES.get(e.dtype, 0)
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
