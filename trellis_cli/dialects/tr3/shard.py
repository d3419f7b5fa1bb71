"""One TR3 shard written from route-pack LayerPacks, and its bit-for-bit read-back.

A shard holds every rank of its layers; it is written rank by rank from one LayerPack at a time (the header is
planned first), so memory stays at one layer-rank, and carried tensors are streamed (dialects/carry.py).
Tensor names follow the TR3 schema, vectors get back the shape the source stored ([n] or [1, n]), and codebook
markers are rewritten from the codebook. write.py's `Tr3Output` writes every shard of an output with it, for
every repack driver that writes TR3 (dialects/tr3/convert.py, dialects/exl3v1/exl3v1_to_tr3.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trellis_cli.checkpoint.model import PROJECTIONS, TensorRef
from trellis_cli.checkpoint.names import H_SIDE, I_SIDE, expert_key, shared_h_key
from trellis_cli.codebooks import MARKERS
from trellis_cli.errors import CheckFailed
from trellis_cli.formats.layer_pack import LayerPack, split_descriptor
from trellis_cli.header import HeaderError, read_local_header
from trellis_cli.dialects import carry
from trellis_cli.checkpoint.bit_compare import same_bits
from trellis_cli.checkpoint.tensor_bytes import TensorReader
from trellis_cli.sources import LocalSource
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter


@dataclass(frozen=True)
class Tr3Layer:
    """What one TR3 shard holds: geometry, K per expert, codebook, rotation layout, vector ranks."""

    layer: int
    expert_k: dict[int, int]
    tp: int
    hidden: int
    intermediate: int  # per rank
    codebook: str
    shared: bool
    vector_ndim: int = 1
    shared_ndim: int = 1

    def _vec_shape(self, n: int, ndim: int) -> tuple[int, ...]:
        return (n,) if ndim == 1 else (1, n)

    def slots(self) -> list[tuple[PlannedTensor, tuple]]:
        """Every tensor in file order (rank-major) with what fills it."""
        h, i = self.hidden, self.intermediate
        marker = MARKERS[self.codebook]
        out: list[tuple[PlannedTensor, tuple]] = []
        for rank in range(self.tp):
            for expert in sorted(self.expert_k):
                k = self.expert_k[expert]
                for p, proj in enumerate(PROJECTIONS):
                    fan_in, fan_out = (h, i) if proj != "down_proj" else (i, h)
                    out.append((PlannedTensor(expert_key(self.layer, expert, proj, rank, "trellis"), "I16",
                                              (fan_in // 16, fan_out // 16, 16 * k)), ("trellis", rank, expert, p)))
                    for field, n in (("suh", fan_in), ("svh", fan_out)):
                        if self.shared and field == H_SIDE[proj]:
                            continue
                        out.append((PlannedTensor(expert_key(self.layer, expert, proj, rank, field), "F16",
                                                  self._vec_shape(n, self.vector_ndim)), (field, rank, expert, p)))
                    if marker is not None:
                        out.append((PlannedTensor(expert_key(self.layer, expert, proj, rank, marker[0]), "I32", ()),
                                    ("marker", rank)))
            if self.shared:
                for p, proj in enumerate(PROJECTIONS):
                    out.append((PlannedTensor(shared_h_key(self.layer, proj, rank), "F16",
                                              self._vec_shape(h, self.shared_ndim)), ("shared", rank, None, p)))
        return out


def tensor_from_pack(spec: Tr3Layer, pack: LayerPack, planned: PlannedTensor, origin: tuple):
    """The bytes one TR3 tensor takes from a LayerPack, shaped as planned."""
    import torch

    kind, _rank, expert, p = (*origin, None, None)[:4]
    if kind == "marker":
        marker = MARKERS[spec.codebook]
        assert marker is not None  # planned only for a codebook with a marker
        return torch.tensor(marker[1], dtype=torch.int32)
    tables = (pack.gate_suh, pack.up_suh, pack.down_svh)
    if kind == "shared":
        return _shared_row(tables[p], spec.layer, PROJECTIONS[p], pack.rank).reshape(planned.shape)
    combined = int(pack.global_to_combined[expert])
    if combined < 0:
        raise CheckFailed(f"layer {spec.layer} rank {pack.rank}: expert {expert} is not served by the pack")
    proj = PROJECTIONS[p]
    if kind == "trellis":
        tier, local = split_descriptor(int(pack.descriptors[combined]))
        return pack.tier_trellis[tier][local, p].reshape(planned.shape)
    if kind == I_SIDE[proj]:
        return pack.rot_intermediate[combined, p].reshape(planned.shape)
    table = tables[p]
    return table[0 if table.shape[0] == 1 else combined].reshape(planned.shape)


def _shared_row(table, layer: int, proj: str, rank: int):
    """The one hidden-side row of a projection; per-expert rows must all be byte-equal to collapse."""
    import torch

    bits = table.view(torch.int16)
    differs = (bits != bits[0:1]).any(dim=1).nonzero()
    if len(differs):
        raise CheckFailed(f"layer {layer} rank {rank}: {proj} {H_SIDE[proj]} rows differ (combined id "
                          f"{int(differs[0])} vs 0); shared-H needs them byte-equal (refused)")
    return table[0]


def write_tr3_shard(path: Path, specs: list[Tr3Layer], packs: Callable[[int, int], LayerPack],
                    carried: list[TensorRef], reader: TensorReader, metadata: dict[str, str],
                    on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Write one TR3 shard: each layer's tensors (one rank's pack in memory at a time), then the carried
    non-expert tensors, streamed. Returns the tensor names in file order."""
    plan = [t for spec in specs for t, _ in spec.slots()] + carry.planned(carried)
    with SafetensorsWriter(path, plan, metadata) as writer:
        for spec in specs:
            layer_packs = _cached_packs(functools.partial(packs, spec.layer))
            for planned, origin in spec.slots():
                writer.write(planned.name, tensor_from_pack(spec, layer_packs(origin[1]), planned, origin))
                if on_bytes is not None:
                    on_bytes(planned.nbytes)
        carry.copy_into(writer, reader, carried, on_bytes)
    return [t.name for t in plan]


def check_tr3_shard(path: Path, specs: list[Tr3Layer], packs: Callable[[int, int], LayerPack],
                    carried: list[TensorRef], reader: TensorReader) -> None:
    """Read the shard back, parsing its header anew, and compare every tensor bit for bit with the packs and
    the carried sources (positional reads: the shard is never mapped or read whole)."""
    try:
        header = read_local_header(path, path.name)
    except (HeaderError, OSError) as e:
        raise CheckFailed(f"{path.name}: written file does not parse ({e})") from e
    expected = {t.name for spec in specs for t, _ in spec.slots()} | {r.name for r in carried}
    if set(header.tensors) != expected:
        raise CheckFailed(f"{path.name}: {sorted(set(header.tensors) ^ expected)[0]}: tensor set differs")
    back = {r.name: r for r in carry.refs_of(header)}
    with TensorReader(LocalSource(path.parent)) as written:
        for spec in specs:
            layer_packs = _cached_packs(functools.partial(packs, spec.layer))
            for planned, origin in spec.slots():
                want = tensor_from_pack(spec, layer_packs(origin[1]), planned, origin)
                ref = back[planned.name]
                if (ref.dtype, ref.shape) != (planned.dtype, planned.shape) or not same_bits(written.read(ref), want):
                    raise CheckFailed(f"{path.name}: {planned.name}: read back differs from the route pack")
    carry.check_copies(path, carried, reader)


def _cached_packs(load: Callable[[int], LayerPack]) -> Callable[[int], LayerPack]:
    """Keep only the most recent rank's pack: writing and checking walk the ranks in order."""
    cache: dict[int, LayerPack] = {}

    def get(rank: int) -> LayerPack:
        if rank not in cache:
            cache.clear()
            cache[rank] = load(rank)
        return cache[rank]

    return get
