"""Read a written layer file back and compare every tensor bit for bit with the source checkpoint.

Independent of the packing path on purpose: the expected tables are rebuilt here from the checkpoint
model, the written file is parsed again by the header parser (not taken from our writer), and each
projection's bytes are compared with the source file's bytes at the header's byte range. The written file
is read once, front to back, and the same pass yields its sha256 for the manifest. A mismatch raises
CheckFailed naming the tensor, expert and projection.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint
from trellis_cli.errors import CheckFailed
from trellis_cli.header import HeaderError, header_length, parse_header
from trellis_cli.formats.layer_pack import DESCRIPTORS, GLOBAL_TO_COMBINED, ROT_DOWN_SVH, ROT_GATE_SUH, ROT_INTERMEDIATE, ROT_UP_SUH, TABLE_NAMES, TIER_K, TIER_SIZE, descriptor, tier_trellis_name
from trellis_cli.dialects.shard_pack import expected_hidden, expected_intermediate, expected_trellis, layer_tiers, linear_slice, source_is_shared_h
from trellis_cli.dialects.tp_reslice import is_identity, rank_pieces
from trellis_cli.checkpoint.bit_compare import bytes_of, equal_bytes, same_bits
from trellis_cli.checkpoint.tensor_bytes import READ_CHUNK, ST_TO_TORCH, Scratch, TensorReader

if TYPE_CHECKING:
    import torch

HIDDEN_TABLES = (ROT_GATE_SUH, ROT_UP_SUH, ROT_DOWN_SVH)


class _WrittenFile:
    """A written file read back front to back in pieces: every byte is hashed exactly once, in order, and
    each tensor's bytes are handed out for comparison on the way (reused buffer, no mmap)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        self.fd = os.open(path, os.O_RDONLY)
        self.pos = 0
        self.digest = hashlib.sha256()
        self.buffer = bytearray(1 << 20)
        try:
            prefix = bytes(self.take(8))
            n = header_length(prefix, path.name, self.size)
            self.header = parse_header(path.name, bytes(self.take(n)), n, self.size)
        except HeaderError as e:
            self.close()
            raise CheckFailed(f"{path.name}: written file does not parse ({e})") from e
        self.order = sorted(self.header.tensors.values(), key=lambda e: e.begin)

    def take(self, n: int) -> memoryview:
        """The next n bytes of the file (valid until the next call), hashed."""
        if len(self.buffer) < n:
            self.buffer = bytearray(n)
        view = memoryview(self.buffer)[:n]
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:done + READ_CHUNK]], self.pos + done)
            if got <= 0:
                raise CheckFailed(f"{self.path.name}: ends at byte {self.pos + done}, expected {self.pos + n}")
            done += got
        self.pos += n
        self.digest.update(view)
        return view

    def tensors(self):
        """(entry, byte source) in file order; the source yields the tensor's bytes in `piece`-sized views."""
        for entry in self.order:
            start = self.header.data_start + entry.begin
            if start < self.pos:
                raise CheckFailed(f"{self.path.name}: {entry.name}: overlaps the tensor before it")
            while self.pos < start:  # bytes between tensors still belong to the file's hash
                self.take(min(start - self.pos, READ_CHUNK))
            yield entry
            if self.pos != start + entry.nbytes:
                raise CheckFailed(f"{self.path.name}: {entry.name}: read {self.pos - start} of {entry.nbytes} bytes")

    def finish(self) -> str:
        while self.pos < self.size:
            self.take(min(self.size - self.pos, READ_CHUNK))
        return self.digest.hexdigest()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _as_tensor(entry, raw: memoryview) -> "torch.Tensor":
    import torch

    dtype = getattr(torch, ST_TO_TORCH[entry.dtype])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(entry.shape)


def check_layer_file(path: Path, checkpoint: Checkpoint, layer: int, rank: int, *, tp: int, shared_h: bool,
                     reader: TensorReader) -> str:
    """Raise CheckFailed unless the file at `path` holds exactly the source's (layer, rank); returns its sha256."""
    written = _WrittenFile(path)
    try:
        _compare(written, checkpoint, layer, rank, tp, shared_h, reader)
        return written.finish()
    finally:
        written.close()


def _compare(written: _WrittenFile, checkpoint: Checkpoint, layer: int, rank: int, tp: int, shared_h: bool,
             reader: TensorReader) -> None:
    moe = checkpoint.layers[layer]
    hidden, inter = checkpoint.moe_sizes()
    pieces, source_width = rank_pieces(inter, checkpoint.tp, tp, rank), inter // checkpoint.tp
    source_shared = source_is_shared_h(checkpoint)
    tiers = layer_tiers(checkpoint, layer)
    num_experts = checkpoint.num_experts or max(moe.experts) + 1
    name = written.path.name
    identity = is_identity(pieces, source_width)
    order = [e for _, ids in tiers for e in ids]
    scratch = Scratch()

    def fail(tensor: str, detail: str) -> CheckFailed:
        return CheckFailed(f"{name}: {tensor}: read back differs from the source ({detail})")

    expected_names = {tier_trellis_name(t) for t in range(len(tiers))} | set(TABLE_NAMES)
    if set(written.header.tensors) != expected_names:
        raise fail(sorted(set(written.header.tensors) ^ expected_names)[0], "tensor set differs")
    tables = _expected_tables(tiers, num_experts)
    for entry in written.tensors():
        if entry.name in tables:
            if not same_bits(_as_tensor(entry, written.take(entry.nbytes)), tables[entry.name]):
                raise fail(entry.name, "table differs")
        elif entry.name == ROT_INTERMEDIATE:
            rot = _as_tensor(entry, written.take(entry.nbytes))
            for c, expert in enumerate(order):
                for p, proj in enumerate(PROJECTIONS):
                    want = expected_intermediate(reader, moe, expert, proj, pieces, source_width, source_shared)
                    if not same_bits(rot[c, p], want):
                        raise fail(entry.name, f"expert {expert} {proj}")
        elif entry.name in HIDDEN_TABLES:
            p = HIDDEN_TABLES.index(entry.name)
            rows = _as_tensor(entry, written.take(entry.nbytes))
            if rows.shape[0] != (1 if shared_h else len(order)):
                raise fail(entry.name, f"{rows.shape[0]} rows")
            for c, expert in enumerate(order):
                want = expected_hidden(reader, moe, expert, PROJECTIONS[p], pieces, hidden, source_shared)
                if not same_bits(rows[0 if shared_h else c], want):
                    raise fail(entry.name, f"expert {expert}")
        else:
            tier = int(entry.name[len("tier"):].split(".")[0])
            ids = tiers[tier][1]
            per_projection = entry.nbytes // max(3 * len(ids), 1)
            for expert in ids:
                for proj in PROJECTIONS:
                    got = written.take(per_projection)
                    if identity:
                        lin = linear_slice(moe, expert, proj, pieces[0].source_rank)
                        if lin.trellis is None:  # linear_slice refuses a missing one
                            raise CheckFailed(f"{lin.prefix}.trellis: missing")
                        expected = reader.read_bytes(lin.trellis, scratch)
                    else:
                        expected = bytes_of(expected_trellis(reader, moe, expert, proj, pieces, hidden, source_width))
                    if not equal_bytes(got, expected):
                        raise fail(entry.name, f"expert {expert} {proj}")


def _expected_tables(tiers, num_experts: int) -> dict[str, "torch.Tensor"]:
    """tier_k, tier_size, global_to_combined and descriptors rebuilt from the tiers alone."""
    import torch

    g2c = torch.full((num_experts,), -1, dtype=torch.int32)
    desc: list[int] = []
    for tier, (_, ids) in enumerate(tiers):
        for local, expert in enumerate(ids):
            g2c[expert] = len(desc)
            desc.append(descriptor(tier, local))
    return {TIER_K: torch.tensor([k for k, _ in tiers], dtype=torch.int32),
            TIER_SIZE: torch.tensor([len(ids) for _, ids in tiers], dtype=torch.int32),
            GLOBAL_TO_COMBINED: g2c, DESCRIPTORS: torch.tensor(desc, dtype=torch.int32)}
