"""Raw tensor bytes from a checkpoint's safetensors files, by the byte ranges its headers give.

Repack moves trellis bytes unchanged, so it reads them straight into their place in an output slab with
`os.preadv` (no intermediate copy, GIL released during the read) instead of materializing each tensor.
Reads are plain positional reads into reused memory, not mmap: page faults on a fresh mapping or a fresh
allocation cost several times the copy itself.
One open handle per file, shared by threads: positional reads need no seek and no lock.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Iterator

from trellis_cli.checkpoint.model import TensorRef
from trellis_cli.errors import CheckFailed

if TYPE_CHECKING:
    import torch

    from trellis_cli.sources import Source

READ_CHUNK = 1 << 20  # large single reads and writes measured several times slower on Linux page cache
ST_TO_TORCH = {"I16": "int16", "F16": "float16", "I32": "int32", "F32": "float32", "BF16": "bfloat16",
               "I64": "int64", "U8": "uint8", "I8": "int8", "F64": "float64"}


def byte_view(tensor: "torch.Tensor") -> memoryview:
    """A writable byte view of a contiguous CPU tensor (shares its memory)."""
    import torch

    return tensor.view(-1).view(torch.uint8).numpy().data.cast("B")


class Scratch:
    """One reusable byte buffer, grown on demand (a new buffer: views of the old one may still be alive)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def get(self, nbytes: int) -> memoryview:
        if len(self._buffer) < nbytes:
            self._buffer = bytearray(nbytes)
        return memoryview(self._buffer)[:nbytes]


class TensorReader:
    """Reads tensors of one checkpoint source by header byte range. Close it (or use `with`) when done."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                fd = os.open(self.source.local_path(file), os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    # A rank reads every tp-th tensor of a shard: ask for the whole file up front so the
                    # disk streams it sequentially instead of seeking tensor by tensor.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                self._fds[file] = fd
            return self._fds[file]

    def prefetch(self, file: str) -> None:
        """Start reading a whole file into the page cache in the background (opening it does that)."""
        self._fd(file)

    def read_into(self, ref: TensorRef, out: "torch.Tensor") -> None:
        """Fill the contiguous CPU tensor `out` (exactly ref.nbytes bytes) with the tensor's stored bytes."""
        view = byte_view(out)
        if len(view) != ref.nbytes:
            raise CheckFailed(f"{ref.file}: {ref.name}: {ref.nbytes} bytes stored, expected {len(view)}")
        self._pread(ref, view)

    def _pread(self, ref: TensorRef, view: memoryview) -> None:
        fd, (offset, _) = self._fd(ref.file), ref.absolute_range
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:done + READ_CHUNK]], offset + done)
            if n <= 0:
                raise CheckFailed(f"{ref.file}: {ref.name}: file ends {len(view) - done} bytes before the tensor does")
            done += n
        with self._lock:
            self.bytes_read += done

    def read_bytes(self, ref: TensorRef, scratch: "Scratch") -> memoryview:
        """The stored bytes in `scratch`'s memory (valid until its next use), for comparing without allocating."""
        view = scratch.get(ref.nbytes)
        self._pread(ref, view)
        return view

    def read_pieces(self, ref: TensorRef, scratch: "Scratch") -> Iterator[memoryview]:
        """The stored bytes in consecutive pieces of at most READ_CHUNK, each in `scratch`'s memory (valid until
        the next piece): a tensor of any size is copied or compared in bounded memory."""
        fd, (offset, end) = self._fd(ref.file), ref.absolute_range
        pos = offset
        while pos < end:
            view = scratch.get(min(READ_CHUNK, end - pos))
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], pos + done)
                if n <= 0:
                    raise CheckFailed(f"{ref.file}: {ref.name}: file ends {end - pos - done} bytes before the "
                                      f"tensor does")
                done += n
            with self._lock:
                self.bytes_read += done
            pos += done
            yield view

    def read(self, ref: TensorRef) -> "torch.Tensor":
        """The tensor with its stored dtype and shape, on CPU."""
        import torch

        if ref.dtype not in ST_TO_TORCH:
            raise CheckFailed(f"{ref.file}: {ref.name}: dtype {ref.dtype} is not one repack reads")
        out = torch.empty(ref.shape, dtype=getattr(torch, ST_TO_TORCH[ref.dtype]))
        self.read_into(ref, out)
        return out

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
