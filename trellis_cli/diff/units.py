"""One side of a diff as logical units, the same for every dialect.

A unit is what one (layer, expert, projection, rank) stores, in one of three parts: the trellis `codes`, the
`intermediate`-side rotation vector (gate/up svh, down suh) and the `hidden`-side one (gate/up suh, down svh).
TR3, plain EXL3, R7 and the route pack store each unit as one run of bytes in one file (a `Span`), so it is
hashed where it lies; an exl3-v1 layer scatters an expert's tiles over its slot rows, and a TR3 compared at
another TP is re-sliced, so those sides are rearranged one (layer, rank) at a time into the route-pack layout
(`LayerPack`, the project's one in-memory form of a layer-rank) and each unit's digest is taken from memory.
The logical shape of codes is TR3's native trellis shape (gate/up `[H/16, I_r/16, 16K]`, down `[I_r/16, H/16,
16K]`); vectors are 1-D. Under shared-H, the one hidden-side row of a (projection, rank) stands for every expert.

Non-expert tensors (attention, embeddings, ...) are units keyed by their tensor name (`OTHER` part).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, NamedTuple

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, LinearRef, TensorRef
from trellis_cli.checkpoint.reader import shard_header
from trellis_cli.dialects.registry import ROUTE_PACK, SHARDS, SLOT_ROWS, storage_of
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.formats.route_pack import (MAX_TIER_EXPERTS, ROT_DOWN_SVH, ROT_GATE_SUH, ROT_INTERMEDIATE, ROT_UP_SUH,
                                            layer_file_name, split_descriptor, tier_trellis_name)
from trellis_cli.id_ranges import expand_ranges

if TYPE_CHECKING:
    from trellis_cli.formats.route_pack import LayerPack

CODES, INTERMEDIATE, HIDDEN, OTHER = "codes", "intermediate", "hidden", "tensor"
INTERMEDIATE_FIELD = {"gate_proj": "svh", "up_proj": "svh", "down_proj": "suh"}
HIDDEN_FIELD = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}
HIDDEN_TABLES = (ROT_GATE_SUH, ROT_UP_SUH, ROT_DOWN_SVH)  # route pack, in projection order
MAX_TIERS = 8  # K is 1..8 bits
EXTRA_DIR = "extra/"  # where a route pack carries the source's non-expert tensors


class Span(NamedTuple):
    """A unit's bytes as one run in one file: [begin, end) absolute offsets."""

    file: str
    begin: int
    end: int


class Unit(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    span: Span | None  # where the bytes lie, or None when they were rearranged in memory
    digest: str | None = None  # sha256, known when rearranged in memory

    @property
    def k(self) -> int | None:
        return self.shape[-1] // 16 if len(self.shape) == 3 and self.shape[-1] % 16 == 0 else None


# (expert, projection, rank, part); for OTHER: (None, tensor name, None, OTHER)
Key = tuple[Any, str, Any, str]


def native_tp(ck: Checkpoint) -> int | None:
    """The TP a side stores; None for exl3-v1, whose slot layout is read at any TP it allows."""
    return None if storage_of(ck) == SLOT_ROWS else max(ck.tp, 1)


def layer_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    """Every unit of MoE layer `layer` at `tp` ranks (empty when the side has no such layer)."""
    if layer not in moe_layers(ck):
        return {}
    if storage_of(ck) == ROUTE_PACK:
        if tp != ck.tp:
            raise CheckFailed(f"{_where(ck)} is a route pack at TP {ck.tp}; its ranks cannot be compared at TP "
                              f"{tp} (convert one side with `trellis repack --to tr3 --tp {tp}`)")
        return _route_pack_units(ck, layer)
    if storage_of(ck) == SLOT_ROWS:
        return _exl3v1_units(ck, layer, tp)
    if tp == max(ck.tp, 1):
        return _span_units(ck, layer)
    return _resliced_units(ck, layer, tp)


def moe_layers(ck: Checkpoint) -> list[int]:
    if storage_of(ck) == ROUTE_PACK:
        layers = ck.declared.get("manifest", {}).get("layers")
        return sorted(int(k) for k in layers if str(k).isdigit()) if isinstance(layers, dict) else []
    return sorted(ck.layers)


# ---- one run of bytes per unit -----------------------------------------------------------------------------

def _span(ref: TensorRef) -> Span:
    return Span(ref.file, *ref.absolute_range)


def _vector(ref: TensorRef) -> Unit:
    return Unit(ref.dtype, (math.prod(ref.shape),), ref.nbytes, _span(ref))


def _span_units(ck: Checkpoint, layer: int) -> dict[Key, Unit]:
    moe = ck.layers[layer]
    units: dict[Key, Unit] = {}
    for expert, projections in moe.experts.items():
        for proj, ranks in projections.items():
            for rank, lin in ranks.items():
                if lin.trellis is not None:
                    t = lin.trellis
                    units[expert, proj, rank, CODES] = Unit(t.dtype, tuple(t.shape), t.nbytes, _span(t))
                inter = getattr(lin, INTERMEDIATE_FIELD[proj])
                if inter is not None:
                    units[expert, proj, rank, INTERMEDIATE] = _vector(inter)
                hidden = _hidden_ref(moe.shared_h, lin, proj, rank)
                if hidden is not None:
                    units[expert, proj, rank, HIDDEN] = _vector(hidden)
    return units


def _hidden_ref(shared_h: dict, lin: LinearRef, proj: str, rank: int) -> TensorRef | None:
    field = HIDDEN_FIELD[proj]
    own = getattr(lin, field)
    return own if own is not None else shared_h.get((proj, rank), {}).get(field)


def expert_tensor_names(ck: Checkpoint) -> set[str]:
    """The names the MoE layers account for (codes, vectors, markers, shared rows, unparsed expert tensors)."""
    names: set[str] = set()
    for moe in ck.layers.values():
        for projections in moe.experts.values():
            for ranks in projections.values():
                for lin in ranks.values():
                    for ref in (lin.trellis, lin.suh, lin.svh, lin.su, lin.sv, lin.mcg, lin.mul1, *lin.extra):
                        if ref is not None:
                            names.add(ref.name)
        names.update(ref.name for row in moe.shared_h.values() for ref in row.values())
        names.update(ref.name for ref in moe.r7_shared.values())
        names.update(ref.name for ref in moe.unparsed)
    return names


def _native_shape(proj: str, hidden: int, width: int, k: int) -> tuple[int, int, int]:
    return (hidden // 16, width // 16, 16 * k) if proj != "down_proj" else (width // 16, hidden // 16, 16 * k)


def _route_pack_units(ck: Checkpoint, layer: int) -> dict[Key, Unit]:
    doc = ck.declared.get("manifest", {})
    geometry = doc.get("geometry") or {}
    hidden, width = geometry.get("hidden"), geometry.get("intermediate_rank")
    layers = doc.get("layers") if isinstance(doc.get("layers"), dict) else {}
    tiers = layers.get(str(layer)).get("tiers") if isinstance(layers.get(str(layer)), dict) else None
    if not _multiple_of_16(hidden) or not _multiple_of_16(width) or not isinstance(tiers, list):
        raise CheckFailed(f"{_where(ck)}: manifest.json has no usable geometry or tiers for layer {layer} "
                          f"(run `trellis validate`)")
    if len(tiers) > MAX_TIERS:  # bounded work whatever the manifest says
        raise CheckFailed(f"{_where(ck)}: manifest.json layer {layer} lists {len(tiers)} tiers, more than the "
                          f"{MAX_TIERS} K values EXL3 has (run `trellis validate`)")
    order = []  # combined order: (tier, local, expert, K)
    for t, tier in enumerate(tiers):
        try:
            ids = expand_ranges(str(tier.get("experts", "")), limit=MAX_TIER_EXPERTS) \
                if isinstance(tier, dict) else []
        except ValueError as e:
            raise CheckFailed(f"{_where(ck)}: manifest.json layer {layer} tier {t}: {e} (run `trellis validate`)")
        order += [(t, local, expert, tier.get("k")) for local, expert in enumerate(ids)]
    units: dict[Key, Unit] = {}
    for rank in range(ck.tp):
        name = layer_file_name(layer, rank)
        if name not in ck.files or ck.files[name] < 0:
            continue  # its units are absent: reported as only in the other side
        header = shard_header(ck, name)
        units.update(_route_pack_file_units(header, name, order, rank, hidden, width))
    return units


def _route_pack_file_units(header: Any, name: str, order: list, rank: int, hidden: int,
                           width: int) -> dict[Key, Unit]:
    """One layer file's units; a tensor whose dtype or shape does not hold the unit leaves it out (absent),
    so no unit ever reads bytes of another tensor."""
    entries, start = header.tensors, header.data_start
    served = len(order)
    inter = _entry(entries, ROT_INTERMEDIATE, "F16", (served, 3, width))
    tables = [entries.get(n) for n in HIDDEN_TABLES]
    tables = [t if t is not None and t.dtype == "F16" and tuple(t.shape) in ((served, hidden), (1, hidden)) else None
              for t in tables]
    units: dict[Key, Unit] = {}
    for combined, (t, local, expert, k) in enumerate(order):
        slab = entries.get(tier_trellis_name(t))
        for p, proj in enumerate(PROJECTIONS):
            if isinstance(k, int) and k > 0 and slab is not None and slab.dtype == "I16" and \
                    len(slab.shape) == 4 and local < slab.shape[0] and slab.shape[1] == 3 and \
                    slab.end - slab.begin == 2 * math.prod(slab.shape):
                size = slab.shape[2] * slab.shape[3] * 2
                begin = start + slab.begin + (local * 3 + p) * size
                units[expert, proj, rank, CODES] = Unit(slab.dtype, _native_shape(proj, hidden, width, k), size,
                                                        Span(name, begin, begin + size))
            if inter is not None:
                begin = start + inter.begin + (combined * 3 + p) * width * 2
                units[expert, proj, rank, INTERMEDIATE] = Unit(inter.dtype, (width,), width * 2,
                                                               Span(name, begin, begin + width * 2))
            table = tables[p]
            if table is not None:
                row = combined if table.shape[0] > 1 else 0
                begin = start + table.begin + row * hidden * 2
                units[expert, proj, rank, HIDDEN] = Unit(table.dtype, (hidden,), hidden * 2,
                                                         Span(name, begin, begin + hidden * 2))
    return units


def _multiple_of_16(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % 16 == 0


def _entry(entries: dict, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    entry = entries.get(name)
    ok = entry is not None and entry.dtype == dtype and tuple(entry.shape) == shape and \
        entry.end - entry.begin == 2 * math.prod(shape)
    return entry if ok else None


# ---- rearranged in memory, one (layer, rank) at a time -----------------------------------------------------

def _exl3v1_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    from trellis_cli.dialects.exl3v1.pack import exl3v1_pack
    from trellis_cli.routepack.source_bytes import TensorReader

    units: dict[Key, Unit] = {}
    with TensorReader(ck.source) as reader:
        for rank in range(tp):
            try:
                pack = exl3v1_pack(ck, layer, rank, tp, reader)
            except UsageError as e:  # a TP the slot layout does not allow, a codebook without a TR3 form
                raise CheckFailed(f"{_where(ck)} layer {layer}: cannot be read at TP {tp}: {e}") from None
            units.update(pack_units(pack))
    return units


def _resliced_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    from trellis_cli.routepack.pack import pack_layer
    from trellis_cli.routepack.source_bytes import TensorReader

    units: dict[Key, Unit] = {}
    with TensorReader(ck.source) as reader:
        for rank in range(tp):
            try:
                pack = pack_layer(ck, layer, rank, tp=tp, reader=reader)
            except UsageError as e:
                raise CheckFailed(f"{_where(ck)} layer {layer}: cannot be re-sliced to TP {tp}: {e}") from None
            units.update(pack_units(pack))
    return units


def pack_units(pack: "LayerPack") -> dict[Key, Unit]:
    """The units of one LayerPack, each with the sha256 of its bytes."""
    from trellis_cli.routepack.source_bytes import byte_view

    units: dict[Key, Unit] = {}
    g2c = pack.global_to_combined.tolist()
    tables = (pack.gate_suh, pack.up_suh, pack.down_svh)
    for expert, combined in enumerate(g2c):
        if combined < 0:
            continue
        t, local = split_descriptor(int(pack.descriptors[combined]))
        k = pack.tier_k[t]
        for p, proj in enumerate(PROJECTIONS):
            codes = pack.tier_trellis[t][local, p].contiguous()
            units[expert, proj, pack.rank, CODES] = _memory_unit(
                "I16", _native_shape(proj, pack.hidden, pack.intermediate, k), byte_view(codes))
            inter = pack.rot_intermediate[combined, p].contiguous()
            units[expert, proj, pack.rank, INTERMEDIATE] = _memory_unit("F16", (pack.intermediate,), byte_view(inter))
            table = tables[p]
            row = table[combined if table.shape[0] > 1 else 0].contiguous()
            units[expert, proj, pack.rank, HIDDEN] = _memory_unit("F16", (pack.hidden,), byte_view(row))
    return units


def _memory_unit(dtype: str, shape: tuple[int, ...], data: memoryview) -> Unit:
    return Unit(dtype, shape, data.nbytes, None, hashlib.sha256(data).hexdigest())


def exl3v1_layer_tensors(ck: Checkpoint, layer: int) -> dict[Key, Unit]:
    """An exl3-v1 layer file's tensors by name (codes, rotations, tables): how two exl3-v1 sides compare when
    their layer files are the same bytes, or when one cannot be read as TR3 ranks (several bit widths per
    expert, the intermediate Hadamard, another codebook)."""
    box = ck.declared.get("exl3v1")
    found = box.layers.get(layer) if box is not None else None
    if found is None or not found.readable:
        return {}
    return {(None, name, None, OTHER): Unit(ref.dtype, tuple(ref.shape), ref.nbytes, _span(ref))
            for name, ref in found.tensors.items()}


# ---- non-expert tensors ------------------------------------------------------------------------------------

def other_units(ck: Checkpoint) -> dict[Key, Unit]:
    """Every tensor outside the MoE expert layout, by name (the first file holding a name wins)."""
    refs: list[TensorRef] = []
    if storage_of(ck) != SHARDS:
        layer_files = _layer_files(ck)
        for name in sorted(ck.files):
            if name.endswith(".safetensors") and name not in layer_files and ck.files[name] >= 0:
                header = shard_header(ck, name)
                refs += [TensorRef(e.name, name, e.dtype, tuple(e.shape), e.begin, e.end, header.data_start)
                         for e in header.tensors.values()]
        strip = EXTRA_DIR if storage_of(ck) == ROUTE_PACK else ""
    else:
        consumed = expert_tensor_names(ck)
        refs = [ref for name, ref in ck.tensors.items() if name not in consumed]
        strip = ""
    units: dict[Key, Unit] = {}
    for ref in refs:
        if strip and not ref.file.startswith(strip):
            continue
        key = (None, ref.name, None, OTHER)
        if key not in units:
            units[key] = Unit(ref.dtype, tuple(ref.shape), ref.nbytes, _span(ref))
    return units


def _layer_files(ck: Checkpoint) -> set[str]:
    if storage_of(ck) == ROUTE_PACK:
        return {name for name in ck.files if name.startswith("layer-") and "/" not in name}
    box = ck.declared.get("exl3v1")
    return {layer.file for layer in box.layers.values()} if box is not None else set()


def _where(ck: Checkpoint) -> str:
    return getattr(ck.source, "description", None) or "the checkpoint"
