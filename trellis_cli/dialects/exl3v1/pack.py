"""One TP rank's extent of an exl3-v1 layer as a route-pack LayerPack, and back: LayerPack ranks -> codes rows.

The LayerPack is the project's one in-memory form of (layer, rank) (formats/layer_pack.py): TR3 shards are
written from it (dialects/tr3/shard.py), the route pack is it on disk, and bench runs it. Moving between it and
exl3-v1 rearranges bytes only (dialects/exl3v1/layout.py says where each 16-channel tile goes); nothing is decoded.
TR3 and the route pack hold one K per expert, so an expert whose records use several bit widths is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header import plain_relative
from trellis_cli.dialects.exl3v1.container import CODES, HIDDEN_TABLES, ROTATIONS, Exl3Layer, container, layer_rates
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.exl3v1.layout import (LayerRates, expert_offsets, plane_span, rank_extent, slot_channels,
                                       slot_tiles, tp_degrees, tp_problem)
from trellis_cli.dialects.exl3v1.schema import SLOT_CHANNELS, Manifest
from trellis_cli.formats.layer_pack import MAX_TIER_EXPERTS, LayerPack, descriptor, split_descriptor, tier_trellis_shape
from trellis_cli.checkpoint.tensor_bytes import TensorReader

if TYPE_CHECKING:
    import torch


def expert_tiers(m: Manifest, rates: LayerRates, layer: int) -> list[tuple[int, list[int]]]:
    """[(K, ascending expert ids)] by ascending K; refused when an expert has no single K."""
    tiers: dict[int, list[int]] = {}
    for e in range(m.num_experts):
        k = rates.expert_k(e, m.num_slots)
        if k is None:
            raise CheckFailed(f"layer {layer}: expert {e} stores its records at several bit widths (pair kinds "
                              f"{sorted(rates.used_kinds())}); TR3 and the route pack hold one K per expert")
        tiers.setdefault(k, []).append(e)
    for k, ids in tiers.items():
        if len(ids) > MAX_TIER_EXPERTS:
            raise CheckFailed(f"layer {layer}: tier K{k} has {len(ids)} experts, more than {MAX_TIER_EXPERTS}")
    return sorted(tiers.items())


def check_convertible(m: Manifest, tp: int) -> None:
    if m.intermediate_hadamard:
        raise UsageError("the exl3-v1 checkpoint uses the intermediate Hadamard, which TR3 and the route pack "
                         "do not have")
    if m.codebook != "mcg":
        raise UsageError(f"codebook {m.codebook}: TR3 and the route pack know mcg, 3inst and mul1 only")
    problem = tp_problem(m, tp)
    if problem:
        raise UsageError(f"--tp {tp}: the slot layout does not allow it ({problem})")


def read_extent_pack(m: Manifest, layer: Exl3Layer, rates: LayerRates, reader: "TensorReader", tp: int,
                     rank: int) -> LayerPack:
    """Rank `rank` of `tp`: its slots' planes gathered into per-expert native trellis tiles."""
    import torch

    check_convertible(m, tp)
    first, count = rank_extent(m, tp, rank)
    width, h16 = count * SLOT_CHANNELS, m.hidden // 16
    codes_ref, rot_ref = layer.ref(CODES), layer.ref(ROTATIONS)
    assert codes_ref is not None and rot_ref is not None  # a layer the container's checks passed
    stride = codes_ref.shape[1]
    tiers = expert_tiers(m, rates, layer.index)
    g2c = torch.full((m.num_experts,), -1, dtype=torch.int32)
    descriptors = torch.empty(m.num_experts, dtype=torch.int32)
    slabs, combined = [], 0
    for t, (k, ids) in enumerate(tiers):
        slabs.append(torch.empty(tier_trellis_shape(len(ids), m.hidden, width, k), dtype=torch.int16))
        for local, e in enumerate(ids):
            g2c[e], descriptors[combined] = combined, descriptor(t, local)
            combined += 1
    row = torch.empty(stride, dtype=torch.uint8)
    for j in range(count):
        reader.read_into(rows_ref(codes_ref, first + j, stride), row)
        offsets = expert_offsets(m, rates, first + j)
        for e in range(m.num_experts):
            tier, local_id = split_descriptor(int(descriptors[int(g2c[e])]))
            expert_tiles = slabs[tier][local_id]
            for matrix in range(3):
                for plane, tile in enumerate(slot_tiles(m, j)):
                    start, length = plane_span(m, rates, first + j, e, matrix, plane, offsets[e])
                    words = row[start:start + length].view(torch.int16).view(h16, -1)
                    _native(expert_tiles[matrix], matrix, h16, width)[_index(matrix, tile)] = words
    rotations = torch.empty((count, m.num_experts, 3, SLOT_CHANNELS), dtype=torch.float16)
    reader.read_into(rows_ref(rot_ref, first, rot_ref.nbytes // m.num_slots, count), rotations)
    channels = torch.tensor([c for j in range(count) for c in slot_channels(m, j)])
    by_expert = torch.empty((m.num_experts, 3, width), dtype=torch.float16)
    by_expert[:, :, channels] = rotations.permute(1, 2, 0, 3).reshape(m.num_experts, 3, width)
    order = torch.tensor([e for _, ids in tiers for e in ids])
    hidden = [_hidden_rows(reader, layer, name, order, m) for name in HIDDEN_TABLES]
    return LayerPack(layer=layer.index, rank=rank, tp=tp, hidden=m.hidden, intermediate=width, codebook="mcg",
                     tier_k=[k for k, _ in tiers], tier_trellis=slabs, global_to_combined=g2c,
                     descriptors=descriptors, rot_intermediate=by_expert[order].contiguous(), gate_suh=hidden[0],
                     up_suh=hidden[1], down_svh=hidden[2])


def rows_ref(ref, row: int, row_bytes: int, rows: int = 1):
    """`rows` consecutive rows (of `row_bytes` each) of a tensor, from row `row`, as a TensorRef to read."""
    begin = ref.begin + row * row_bytes
    return ref._replace(begin=begin, end=begin + rows * row_bytes)


def _native(projection: "torch.Tensor", matrix: int, h16: int, width: int) -> "torch.Tensor":
    """A projection's [tiles, 16K] slab as the native [K/16, N/16, 16K] trellis (gate/up: K = H; down: K = I_r)."""
    shape = (h16, width // 16) if matrix < 2 else (width // 16, h16)
    return projection.view(*shape, projection.shape[-1])


def _index(matrix: int, tile: int):
    """The 16-channel intermediate tile: an N16 column of gate/up, a K16 row of down."""
    return (slice(None), tile) if matrix < 2 else (tile,)


def _hidden_rows(reader, layer: Exl3Layer, name: str, order, m: Manifest) -> "torch.Tensor":
    import torch

    ref = layer.ref(name)
    assert ref is not None  # a layer the container's checks passed
    table = torch.empty(ref.shape, dtype=torch.float16)
    reader.read_into(ref, table)
    return table[order].contiguous() if m.per_expert_input_rotations else table.reshape(1, m.hidden)


def pack_rows(m: Manifest, rates: LayerRates, pack: LayerPack, stride: int):
    """The codes rows of one rank's slots, built from its LayerPack (the inverse of read_extent_pack)."""
    import torch

    count, h16 = pack.intermediate // SLOT_CHANNELS, m.hidden // 16
    first = pack.rank * count
    for j in range(count):
        row = torch.zeros(stride, dtype=torch.uint8)
        offsets = expert_offsets(m, rates, first + j)
        for e in range(m.num_experts):
            t, local = split_descriptor(int(pack.descriptors[int(pack.global_to_combined[e])]))
            source = pack.tier_trellis[t][local]
            for matrix in range(3):
                for plane, tile in enumerate(slot_tiles(m, j)):
                    start, length = plane_span(m, rates, first + j, e, matrix, plane, offsets[e])
                    words = _native(source[matrix], matrix, h16, pack.intermediate)[_index(matrix, tile)]
                    row[start:start + length] = words.contiguous().view(-1).view(torch.uint8)
        yield row.numpy().data


def pack_rotations(m: Manifest, pack: LayerPack, out: "torch.Tensor") -> None:
    """Fill one rank's rows of the [num_slots, E, 3, 32] rotations from its LayerPack's intermediate vectors."""
    import torch

    count = pack.intermediate // SLOT_CHANNELS
    channels = torch.tensor([c for j in range(count) for c in slot_channels(m, j)])
    combined = pack.global_to_combined.long()
    if (combined < 0).any():
        raise CheckFailed(f"layer {pack.layer} rank {pack.rank}: not every expert is served")
    vectors = pack.rot_intermediate[combined][:, :, channels]  # [E, 3, count*32] in slot order
    first = pack.rank * count
    out[first:first + count] = vectors.reshape(m.num_experts, 3, count, SLOT_CHANNELS).permute(2, 0, 1, 3)


# ---- one (layer, rank) of an exl3-v1 checkpoint as a LayerPack: what bench runs and repack writes ---------

NOTE_KEY = "trellis_exl3v1"  # in a carried config.json: what restoring the TR3 layout needs
DEFAULT_MAX_TP = 4


def exl3v1_pack(ck: Checkpoint, layer: int, rank: int, tp: int, reader: TensorReader | None = None) -> LayerPack:
    """One (layer, rank) of an exl3-v1 checkpoint in the route-pack layout (what bench and repack run)."""
    box = container(ck)
    if box.manifest is None or layer not in box.layers or not box.layers[layer].readable:
        raise CheckFailed(f"layer {layer}: not readable in this exl3-v1 checkpoint (run `trellis validate`)")
    rates = checked_rates(ck, layer)
    if not 0 <= rank < tp:
        raise UsageError(f"rank {rank} is outside 0..{tp - 1}")
    if reader is not None:
        return read_extent_pack(box.manifest, box.layers[layer], rates, reader, tp, rank)
    with TensorReader(ck.source) as own:
        return read_extent_pack(box.manifest, box.layers[layer], rates, own, tp, rank)


def checked_rates(ck: Checkpoint, layer: int) -> LayerRates:
    rates = layer_rates(ck, layer)
    if rates is None:
        raise CheckFailed(f"layer {layer}: the rate tables cannot be read (run `trellis validate`)")
    return rates


def note_problems(ck: Checkpoint) -> list[tuple[str, str, Any]]:
    """What is wrong with config.json's NOTE_KEY (written by `repack TR3 --to exl3-v1`), as (key, expected,
    found): it must be an object whose `tp` is an integer, `vector_ndim` {per_expert, shared_h} each 1 or 2, and
    `shard_names` an object of layer -> a relative `.safetensors` name under OUT (never a path elsewhere)."""
    note = ck.config.get(NOTE_KEY) if isinstance(ck.config, dict) else None
    if note is None:
        return []
    if not isinstance(note, dict):
        return [("", "an object", note)]
    problems: list[tuple[str, str, Any]] = []
    if "tp" in note and type(note["tp"]) is not int:
        problems.append((".tp", "an integer", note["tp"]))
    ndim = note.get("vector_ndim", {})
    if not isinstance(ndim, dict):
        problems.append((".vector_ndim", "an object {per_expert, shared_h}", ndim))
    else:
        problems += [(f".vector_ndim.{key}", "1 or 2", ndim[key]) for key in ("per_expert", "shared_h")
                     if key in ndim and (type(ndim[key]) is not int or ndim[key] not in (1, 2))]
    names = note.get("shard_names", {})
    if not isinstance(names, dict):
        problems.append((".shard_names", "an object of layer -> shard file name", names))
    else:
        problems += [(f".shard_names[{key!r}]", "a relative `.safetensors` file name under OUT (no absolute path, "
                      "`..`, empty part or backslash)", name) for key, name in names.items()
                     if not (plain_relative(name) and name.endswith(".safetensors"))]
    return problems


def shown_value(found: Any) -> str:
    text = repr(found) if len(repr(found)) <= 80 else repr(found)[:77] + "..."
    return f"{text} (a JSON {type(found).__name__})"


def conversion_note(ck: Checkpoint) -> dict[str, Any]:
    """The note, checked before a conversion uses it ({} when absent); its first problem is refused by name."""
    for key, expected, found in note_problems(ck)[:1]:
        raise CheckFailed(f"[exl3v1.note] config.json {NOTE_KEY}{key}: expected {expected}, found "
                          f"{shown_value(found)}; "
                          f"the note says how to restore the TR3 layout: fix or remove it (without it, default shard "
                          f"names and [n] vectors are written)", code="exl3v1.note")
    return ck.config.get(NOTE_KEY) or {}


def default_tp(ck: Checkpoint) -> int:
    # Lenient (bench needs only a TP); a conversion refuses a bad note through conversion_note before using it.
    note = ck.config.get(NOTE_KEY) if isinstance(ck.config, dict) else None
    tp = note.get("tp") if isinstance(note, dict) else None
    m = container(ck).manifest
    assert m is not None  # an opened container that parsed
    allowed = tp_degrees(m)
    if type(tp) is int and tp in allowed:
        return tp
    return max((tp for tp in allowed if tp <= DEFAULT_MAX_TP), default=1)
