"""TR3 -> exl3-v1 in the exl3-v1 format's terms: the manifest and rates a TR3 checkpoint's K allow, one layer file
written from its rank-sliced LayerPacks, and the written file read back through the exl3-v1 reader.

Exact or refused. exl3-v1 holds one hidden-side vector per layer (and expert, for per_expert_v1), with no
rank axis, so every rank's gate/up suh and down svh must be byte-identical; `check_hidden_side_equal` checks
that for every selected layer before anything is written. Uniform K -> `uniform` rates; several K ->
`per_expert_pair` with P{K}{K} in every pair of an expert, in record-major placement. Per layer: the
intermediate vectors (small) first, then the codes rows one rank at a time from that rank's LayerPack (memory:
one layer-rank), then the written file is read back and compared with the source rank by rank. The repack
driver around it (plan, stage, carried files, manifest) is dialects/exl3v1/tr3_to_exl3v1.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.exl3v1.container import HIDDEN_TABLES, RATES_FC1, RATES_FC2, ROTATIONS, Exl3Layer
from trellis_cli.dialects.exl3v1.layout import LayerRates, slot_channels
from trellis_cli.dialects.exl3v1.pack import pack_rows, read_extent_pack
from trellis_cli.dialects.exl3v1.schema import PER_EXPERT_PAIR, SLOT_CHANNELS, SLOTS_PER_PAIR, UNIFORM, Manifest
from trellis_cli.dialects.exl3v1.write import row_stride, write_layer
from trellis_cli.dialects.shard_pack import HIDDEN_SIDE, expected_hidden, expected_intermediate, pack_layer
from trellis_cli.dialects.tp_reslice import rank_pieces
from trellis_cli.checkpoint.bit_compare import same_bits
from trellis_cli.checkpoint.tensor_bytes import TensorReader

PAIR_K = (2, 3, 4)


def target_manifest(ck: Checkpoint, tiers: dict[int, list[tuple[int, list[int]]]]) -> Manifest:
    ks = sorted({k for layer_tiers_ in tiers.values() for k, _ in layer_tiers_})
    codebooks = {lin.codebook for li in tiers for projs in ck.layers[li].experts.values() for ranks in projs.values()
                 for lin in ranks.values()}
    if codebooks != {"mcg"}:
        raise UsageError(f"--to exl3-v1: the experts use codebook(s) {sorted(codebooks)}; exl3-v1 names mcg only")
    hidden, intermediate = ck.moe_sizes()
    if ck.num_experts is None:  # inferred from the expert ids where undeclared: never None with experts present
        raise CheckFailed("the source declares no experts per layer")
    per_rank = intermediate // ck.tp
    mixed = len(ks) > 1
    if mixed and (per_rank % (SLOTS_PER_PAIR * SLOT_CHANNELS) or any(k not in PAIR_K for k in ks)):
        raise UsageError(f"--to exl3-v1: mixed K {ks} needs per_expert_pair rates: K2..K4 and whole 256-channel "
                         f"pairs per rank ({per_rank} intermediate channels per rank)")
    if not mixed and ks[0] not in range(2, 7):
        raise UsageError(f"--to exl3-v1: K{ks[0]} is outside the 2..6 that exl3-v1 rates allow")
    return Manifest(codebook="mcg", num_experts=ck.num_experts, hidden=hidden, intermediate=intermediate,
                    num_slots=intermediate // SLOT_CHANNELS, layer_indices=tuple(tiers),
                    structure=PER_EXPERT_PAIR if mixed else UNIFORM, bits=None if mixed else ks[0],
                    pair_kinds=tuple(f"P{k}{k}" for k in ks) if mixed else (), intermediate_hadamard=False,
                    per_expert_input_rotations=ck.rotation_layout == "per_expert_v1", pre_block=None,
                    post_block=None, row_alignment=4096, extent_alignment=SLOTS_PER_PAIR if mixed else 4,
                    barriers=(), codebook_seed=None)


def rates_for(m: Manifest, tiers: list[tuple[int, list[int]]]) -> LayerRates:
    if not m.pair_structure:
        assert m.bits is not None  # target_manifest declares the bits of uniform rates
        return LayerRates((m.bits << 4) | m.bits)
    k_of = {e: k for k, ids in tiers for e in ids}
    row = tuple(17 * k_of[e] for e in range(m.num_experts))
    return LayerRates(None, (row,) * m.pairs, (row,) * m.pairs)


def check_hidden_side_equal(ck: Checkpoint, layers: list[int]) -> None:
    """Refuse (before writing) the first layer, expert, projection and rank whose hidden-side vector differs."""
    import torch

    shared = ck.rotation_layout == "shared_h_v1"
    hidden, intermediate = ck.moe_sizes()
    with TensorReader(ck.source) as reader:
        for li in layers:
            moe = ck.layers[li]
            for e in ([0] if shared else sorted(moe.experts)):
                for proj in PROJECTIONS:
                    first = expected_hidden(reader, moe, e, proj, rank_pieces(intermediate, ck.tp, ck.tp, 0),
                                            hidden, shared).view(torch.int16)
                    for rank in range(1, ck.tp):
                        pieces = rank_pieces(intermediate, ck.tp, ck.tp, rank)
                        other = expected_hidden(reader, moe, e, proj, pieces, hidden, shared).view(torch.int16)
                        if not torch.equal(first, other):
                            at = int((first != other).nonzero()[0])
                            who = f"layer {li}" + ("" if shared else f" expert {e}")
                            raise CheckFailed(
                                f"[exl3v1.h-side-differs] {who} {proj} {HIDDEN_SIDE[proj]}: rank {rank} differs from "
                                f"rank 0 (first at element {at}); exl3-v1 holds one hidden-side vector per "
                                f"{'layer' if shared else 'layer and expert'}, and each rank's trellis codes were "
                                "chosen under its own vector, so only re-quantization could merge them (refused, "
                                "nothing written)")


def _small_tables(ck: Checkpoint, m: Manifest, li: int, tiers) -> dict[str, Any]:
    """rotations [S, E, 3, 32] from every rank's intermediate vectors, hidden-side tables from rank 0."""
    import torch

    moe, shared = ck.layers[li], ck.rotation_layout == "shared_h_v1"
    width = m.intermediate // ck.tp  # the source's intermediate size (target_manifest)
    count = width // SLOT_CHANNELS
    channels = torch.tensor([c for j in range(count) for c in slot_channels(m, j)])
    rotations = torch.empty((m.num_slots, m.num_experts, 3, SLOT_CHANNELS), dtype=torch.float16)
    rows = m.num_experts if m.per_expert_input_rotations else 1
    hidden = {name: torch.empty((rows, m.hidden), dtype=torch.float16) for name in HIDDEN_TABLES}
    with TensorReader(ck.source) as reader:
        for rank in range(ck.tp):
            pieces = rank_pieces(m.intermediate, ck.tp, ck.tp, rank)
            for e in range(m.num_experts):
                for p, proj in enumerate(PROJECTIONS):
                    vec = expected_intermediate(reader, moe, e, proj, pieces, width, shared)
                    rotations[rank * count:(rank + 1) * count, e, p] = vec[channels].view(count, SLOT_CHANNELS)
                    if rank == 0 and e < rows:
                        hidden[HIDDEN_TABLES[p]][e] = expected_hidden(reader, moe, e, proj, pieces, m.hidden, shared)
    tables = {ROTATIONS: rotations}
    tables.update({n: t if m.per_expert_input_rotations else t.reshape(m.hidden) for n, t in hidden.items()})
    return tables


def write_converted_layer(ck: Checkpoint, m: Manifest, li: int, tiers, path: Path, on_bytes) -> None:
    rates = rates_for(m, tiers)
    stride = row_stride(m, rates)
    tables = _small_tables(ck, m, li, tiers)
    if m.pair_structure:
        import torch

        tables[RATES_FC1] = torch.tensor(rates.fc1, dtype=torch.uint8)
        tables[RATES_FC2] = torch.tensor(rates.fc2, dtype=torch.uint8)

    def rows():
        with TensorReader(ck.source) as reader:
            for rank in range(ck.tp):
                pack = pack_layer(ck, li, rank, reader=reader)
                for row in pack_rows(m, rates, pack, stride):
                    yield row
                    on_bytes(len(row))
                del pack

    write_layer(path, m, li, stride, tables.get, rows())
    verify_layer_file(ck, m, li, rates, path)


def verify_layer_file(ck: Checkpoint, m: Manifest, li: int, rates: LayerRates, path: Path) -> None:
    """Read the written file back through the exl3-v1 reader; every rank's pack must equal the source's."""
    from trellis_cli.checkpoint.model import TensorRef
    from trellis_cli.header import read_local_header
    from trellis_cli.sources import LocalSource

    header = read_local_header(path, path.name)
    layer = Exl3Layer(li, path.name, "", {n: TensorRef(n, path.name, e.dtype, e.shape, e.begin, e.end,
                                                       header.data_start) for n, e in header.tensors.items()},
                      header.metadata, True)
    with TensorReader(LocalSource(path.parent)) as written, TensorReader(ck.source) as source:
        for rank in range(ck.tp):
            got = read_extent_pack(m, layer, rates, written, ck.tp, rank)
            want = pack_layer(ck, li, rank, reader=source)
            pairs = [("tier_k", got.tier_k == want.tier_k), ("global_to_combined", same_bits(
                got.global_to_combined, want.global_to_combined)), ("descriptors", same_bits(
                got.descriptors, want.descriptors)), ("rot.intermediate", same_bits(
                got.rot_intermediate, want.rot_intermediate))]
            pairs += [(f"tier{t}.trellis", same_bits(a, b)) for t, (a, b) in
                      enumerate(zip(got.tier_trellis, want.tier_trellis))]
            pairs += [(n, same_bits(getattr(got, n), getattr(want, n))) for n in HIDDEN_TABLES]
            bad = [name for name, ok in pairs if not ok]
            if bad:
                raise CheckFailed(f"{path.name}: rank {rank}: {bad[0]} read back differs from the TR3 source")


__all__ = ["check_hidden_side_equal", "target_manifest", "write_converted_layer"]
