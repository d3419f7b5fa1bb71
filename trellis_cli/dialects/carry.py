"""Non-expert tensors carried through a repack: which they are, streamed copies, and their read-back.

A shard that holds routed experts may also hold other tensors (an embedding, an lm_head, norms). They are
moved as stored bytes in pieces of at most READ_CHUNK (source_bytes.py), never as whole tensors, so a
6 GB embedding costs a worker no more memory than a small norm; each copy is then read back from disk,
piece by piece, and compared with its source, so a carried tensor is verified like a routed expert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from trellis_cli.checkpoint.model import Checkpoint, TensorRef
from trellis_cli.checkpoint.names import is_expert_name
from trellis_cli.errors import CheckFailed
from trellis_cli.header import HeaderError, read_local_header
from trellis_cli.header_records import Header
from trellis_cli.checkpoint.bit_compare import equal_bytes
from trellis_cli.checkpoint.tensor_bytes import Scratch, TensorReader
from trellis_cli.sources import LocalSource
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter, canonical_order, encode_header


def refs_of(header: Header, names: list[str] | None = None) -> list[TensorRef]:
    """TensorRefs of a header's tensors (all, or `names`), in the order their bytes are stored."""
    entries = header.tensors.values() if names is None else (header.tensors[n] for n in names)
    refs = [TensorRef(e.name, header.file, e.dtype, e.shape, e.begin, e.end, header.data_start) for e in entries]
    return sorted(refs, key=lambda r: r.begin)


def non_expert_refs(checkpoint: Checkpoint) -> dict[str, list[TensorRef]]:
    """Safetensors files that hold routed experts and other tensors -> the other tensors, in stored order.
    (A file without routed experts is copied whole instead.)"""
    out = {}
    for file, header in checkpoint.headers.items():
        kinds = [not is_expert_name(n) for n in header.tensors]
        if any(kinds) and not all(kinds):
            out[file] = refs_of(header, [n for n, other in zip(header.tensors, kinds) if other])
    return out


def planned(refs: list[TensorRef]) -> list[PlannedTensor]:
    return [PlannedTensor(r.name, r.dtype, r.shape) for r in refs]


def file_bytes(tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> int:
    """The size of the safetensors file these tensors make (header included)."""
    return len(encode_header(canonical_order(tensors), metadata)) + sum(t.nbytes for t in tensors)


def copy_into(writer: SafetensorsWriter, reader: TensorReader, refs: list[TensorRef],
              on_bytes: Callable[[int], None] | None = None) -> None:
    """Append each ref's stored bytes to `writer` (planned in this order), in bounded pieces."""
    scratch = Scratch()
    for ref in refs:
        writer.write_parts(ref.name, reader.read_pieces(ref, scratch))
        if on_bytes is not None:
            on_bytes(ref.nbytes)


def write_subset(target: Path, refs: list[TensorRef], reader: TensorReader, metadata: dict[str, str]) -> None:
    """A new safetensors file holding exactly `refs` (bytes unchanged), then read back and compared."""
    with SafetensorsWriter(target, planned(refs), metadata) as writer:
        copy_into(writer, reader, refs)
    check_copies(target, refs, reader)


def check_copies(path: Path, refs: list[TensorRef], reader: TensorReader) -> None:
    """Raise CheckFailed unless the written file at `path` stores each ref's dtype, shape and bytes."""
    try:
        header = read_local_header(path, path.name)
    except (HeaderError, OSError) as e:
        raise CheckFailed(f"{path.name}: written file does not parse ({e})") from e
    with TensorReader(LocalSource(path.parent)) as written:
        mine, theirs = Scratch(), Scratch()
        for ref in refs:
            entry = header.tensors.get(ref.name)
            if entry is None or (entry.dtype, entry.shape) != (ref.dtype, ref.shape):
                raise CheckFailed(f"{path.name}: {ref.name}: read back differs from the source (dtype or shape)")
            back = TensorRef(ref.name, path.name, entry.dtype, entry.shape, entry.begin, entry.end, header.data_start)
            if back.nbytes != ref.nbytes or any(
                    not equal_bytes(a, b) for a, b in zip(written.read_pieces(back, mine), reader.read_pieces(ref, theirs))):
                raise CheckFailed(f"{path.name}: {ref.name}: read back differs from the source")
