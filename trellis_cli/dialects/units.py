"""A checkpoint as logical units, the terms `trellis diff` compares in, and the per-linear shards' answer.

A unit is what one (layer, expert, projection, rank) stores, in one of three parts: the trellis `codes`, the
`intermediate`-side rotation vector (gate/up svh, down suh) and the `hidden`-side one (gate/up suh, down svh).
TR3, plain EXL3, R7 and the route pack store each unit as one run of bytes in one file (a `Span`), so it is
hashed where it lies; an exl3-v1 layer scatters an expert's tiles over its slot rows, and a TR3 compared at
another TP is re-sliced, so those sides are rearranged one (layer, rank) at a time into the route-pack layout
(`LayerPack`, the project's one in-memory form of a layer-rank) and each unit's digest is taken from memory.
The logical shape of codes is TR3's native trellis shape (gate/up `[H/16, I_r/16, 16K]`, down `[I_r/16, H/16,
16K]`); vectors are 1-D. Under shared-H, the one hidden-side row of a (projection, rank) stands for every expert.

Non-expert tensors (attention, embeddings, ...) are units keyed by their tensor name (`OTHER` part).

This module holds the unit model and what every per-linear shard dialect answers (the `Dialect` defaults); a
dialect that stores its bytes another way answers from its own package (routepack/units.py, exl3v1/units.py).
"""

from __future__ import annotations

import hashlib
import math
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from trellis_cli.checkpoint import layer_columns
from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, TensorRef
from trellis_cli.checkpoint.tensor_map import outside_experts
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.formats.layer_pack import split_descriptor

if TYPE_CHECKING:
    from trellis_cli.formats.layer_pack import LayerPack

CODES, INTERMEDIATE, HIDDEN, OTHER = "codes", "intermediate", "hidden", "tensor"
INTERMEDIATE_FIELD = {"gate_proj": "svh", "up_proj": "svh", "down_proj": "suh"}
HIDDEN_FIELD = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}


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


def where(ck: Checkpoint) -> str:
    """How a refusal names the side: its source's description."""
    return ck.source.description or "the checkpoint"


def span_of(ref: TensorRef) -> Span:
    return Span(ref.file, *ref.absolute_range)


def tensor_unit(ref: TensorRef) -> Unit:
    """A tensor compared whole, where it lies."""
    return Unit(ref.dtype, tuple(ref.shape), ref.nbytes, span_of(ref))


def native_shape(proj: str, hidden: int, width: int, k: int) -> tuple[int, int, int]:
    return (hidden // 16, width // 16, 16 * k) if proj != "down_proj" else (width // 16, hidden // 16, 16 * k)


# ---- per-linear shards (the Dialect defaults) ---------------------------------------------------------------

def shard_layer_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    """A per-linear shard layer at `tp`: where its bytes lie at the stored TP, else re-sliced in memory."""
    if tp == max(ck.tp, 1):
        return _span_units(ck, layer)
    return _resliced_units(ck, layer, tp)


def _span_units(ck: Checkpoint, layer: int) -> dict[Key, Unit]:
    moe = ck.layers[layer]
    units: dict[Key, Unit] = {}
    new, unit, span = tuple.__new__, Unit, Span  # records built in C: ~700k units at production size
    vector_shapes: dict[tuple[int, ...], tuple[int]] = {}  # a vector's shape -> its one dimension (a layer has few)
    for expert, projections in moe.experts.items():
        for proj, ranks in projections.items():
            intermediate_of, hidden_of = _INTERMEDIATE_OF[proj], _HIDDEN_OF[proj]
            for rank, lin in ranks.items():
                t = lin.trellis
                if t is not None:
                    at = t.data_start
                    units[expert, proj, rank, CODES] = new(unit, (t.dtype, tuple(t.shape), t.end - t.begin,
                                                                  new(span, (t.file, at + t.begin, at + t.end)), None))
                for part, ref in ((INTERMEDIATE, intermediate_of(lin)),
                                  (HIDDEN, hidden_of(lin) or _shared_hidden(moe.shared_h, proj, rank))):
                    if ref is not None:
                        at, shape = ref.data_start, tuple(ref.shape)
                        flat = vector_shapes.get(shape)
                        if flat is None:
                            flat = vector_shapes[shape] = (math.prod(shape),)
                        units[expert, proj, rank, part] = new(unit, (ref.dtype, flat, ref.end - ref.begin,
                                                                     new(span, (ref.file, at + ref.begin, at + ref.end)),
                                                                     None))
    return units


_INTERMEDIATE_OF = {proj: attrgetter(field) for proj, field in INTERMEDIATE_FIELD.items()}
_HIDDEN_OF = {proj: attrgetter(field) for proj, field in HIDDEN_FIELD.items()}


def _shared_hidden(shared_h: dict, proj: str, rank: int) -> TensorRef | None:
    """Under shared-H, the one hidden-side row of (projection, rank) that stands for every expert."""
    return shared_h.get((proj, rank), {}).get(HIDDEN_FIELD[proj]) if shared_h else None


class BulkUnits(NamedTuple):
    """A per-linear shard layer's units without a record each: as many as `_span_units` builds, where their bytes
    lie, and the facts a diff summary reads from them (diff/run.py `_unit_facts`: the same sums, taken by column)."""

    total: int  # units
    spans: dict[str, tuple[np.ndarray, np.ndarray]]  # file -> absolute begins, ends of its units (one per unit)
    expert_ks: dict[int, frozenset[int | None]]  # expert -> the K its codes' shapes give (None: the shape gives none)
    bits: int  # 8 x the bytes of the 3-D codes
    weights: int  # 256 x shape[0] x shape[1] of the same codes
    rank_bytes: dict[int, int]  # rank -> the bytes of its units


def shard_bulk_units(ck: Checkpoint, layer: int, tp: int) -> BulkUnits | None:
    """`shard_layer_units`' units of `layer` as columns (LayerColumns), for a layer read where it lies; None where
    the columns alone cannot give the same units (read at another TP, linears laid out unevenly, a linear without
    its trellis): then only the records say.

    Equal by construction: `_span_units` makes, for each linear, a codes unit of its trellis, an intermediate unit
    of its INTERMEDIATE_FIELD vector and a hidden unit of its HIDDEN_FIELD vector or else its shared-H row, each
    where present, with its span and end - begin bytes. Here the same refs are taken per (projection, rank) slice
    of the columns (a regular layout: linear `(e * P + p) * R + r`), the shared row standing in once for each
    linear without a hidden vector, as the records repeat it."""
    if tp != max(ck.tp, 1):
        return None
    moe = ck.layers[layer]
    cols = layer_columns.columns(moe)
    layout = cols.layout()
    trellis = cols.field(layer_columns.TRELLIS)
    if (layout is None or not trellis or cols.present(layer_columns.TRELLIS) != len(trellis)
            or not set(layout[0]) <= INTERMEDIATE_FIELD.keys()):
        return None
    projs, ranks = layout
    period = len(projs) * len(ranks)
    refs: list[TensorRef] = list(trellis)
    runs: list[tuple[int, int]] = []  # (rank, how many) of each (projection, rank)'s vectors, as they follow in refs
    for p, proj in enumerate(projs):
        intermediate = cols.field(_FIELD_INDEX[INTERMEDIATE_FIELD[proj]])
        hidden = cols.field(_FIELD_INDEX[HIDDEN_FIELD[proj]])
        for r, rank in enumerate(ranks):
            at = p * len(ranks) + r  # this (projection, rank)'s linears: every period-th from here
            held = [*filter(None, intermediate[at::period]), *filter(None, hidden[at::period])]
            missing = hidden[at::period].count(None)
            row = _shared_hidden(moe.shared_h, proj, rank) if missing else None
            if row is not None:
                held += [row] * missing
            refs += held
            runs.append((rank, len(held)))
    begins, ends = _column(_BEGIN, refs), _column(_END, refs)
    nbytes = ends - begins
    codes = nbytes[:len(trellis)]
    # codes by rank (a linear's rank is its index mod len(ranks)), then each run of vectors to its rank
    rank_bytes = dict(zip(ranks, codes.reshape(-1, len(ranks)).sum(axis=0).tolist()))
    bounds = np.cumsum([len(trellis)] + [n for _, n in runs])
    total = np.concatenate(([0], np.cumsum(nbytes)))
    for (rank, _), run in zip(runs, (total[bounds[1:]] - total[bounds[:-1]]).tolist()):
        rank_bytes[rank] += run
    shapes = list(map(_SHAPE, trellis))
    kinds = {shape: i for i, shape in enumerate(dict.fromkeys(shapes))}
    of_kind = np.fromiter(map(kinds.__getitem__, shapes), dtype=np.int64, count=len(shapes)) if len(kinds) > 1 else None
    bits = weights = 0
    for shape, i in kinds.items():
        if len(shape) == 3:
            mine = codes if of_kind is None else codes[of_kind == i]
            bits += 8 * int(mine.sum())
            weights += shape[0] * shape[1] * 256 * len(mine)
    starts = _column(_DATA_START, refs)
    return BulkUnits(len(refs), _by_file(refs, starts + begins, starts + ends), cols.expert_ks(), bits, weights,
                     rank_bytes)


def _column(field: Any, refs: list[TensorRef]) -> np.ndarray:
    return np.fromiter(map(field, refs), dtype=np.int64, count=len(refs))


def _by_file(refs: list[TensorRef], begins: np.ndarray, ends: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """file -> the begins and ends of `refs` there, files in the order `refs` first name them."""
    files = list(map(_FILE, refs))
    if files.count(files[0]) == len(files):  # a layer in one shard
        return {files[0]: (begins, ends)}
    order = {file: i for i, file in enumerate(dict.fromkeys(files))}
    of_file = np.fromiter(map(order.__getitem__, files), dtype=np.int64, count=len(files))
    return {file: (begins[of_file == i], ends[of_file == i]) for file, i in order.items()}


_FIELD_INDEX = {"suh": layer_columns.SUH, "svh": layer_columns.SVH}
_FILE, _SHAPE, _DATA_START = attrgetter("file"), attrgetter("shape"), attrgetter("data_start")
_BEGIN, _END = attrgetter("begin"), attrgetter("end")


def _resliced_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    from trellis_cli.dialects.shard_pack import pack_layer
    from trellis_cli.checkpoint.tensor_bytes import TensorReader

    units: dict[Key, Unit] = {}
    with TensorReader(ck.source) as reader:
        for rank in range(tp):
            try:
                pack = pack_layer(ck, layer, rank, tp=tp, reader=reader)
            except UsageError as e:
                raise CheckFailed(f"{where(ck)} layer {layer}: cannot be re-sliced to TP {tp}: {e}") from None
            units.update(pack_units(pack))
    return units


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


def shard_other_units(ck: Checkpoint, from_tensors: bool = False) -> dict[Key, Unit]:
    """Every tensor of the shards the MoE layers do not account for, by name (the first file holding it wins).
    `from_tensors`: the layers were built by the shared opening from `ck.tensors`."""
    # Such layers hold tensors of ck.tensors under `.mlp.experts.`, each once: where they hold as many as there are
    # such names, they hold all of them, and the others are the rest (no set of ~935k names).
    if from_tensors:
        others = outside_experts(ck.tensors)
        if _held(ck) == len(ck.tensors) - len(others):
            return named_units(others)
    consumed = expert_tensor_names(ck)
    return named_units(ref for name, ref in ck.tensors.items() if name not in consumed)


def _held(ck: Checkpoint) -> int:
    """How many tensors the MoE layers hold (codes, vectors, markers, extra fields, shared rows, unparsed)."""
    held = 0
    for moe in ck.layers.values():
        held += layer_columns.columns(moe).tensors_held()
        held += sum(map(len, moe.shared_h.values())) + len(moe.r7_shared) + len(moe.unparsed)
    return held


def named_units(refs: Any) -> dict[Key, Unit]:
    """Tensors as OTHER units keyed by name; the first of a name wins."""
    units: dict[Key, Unit] = {}
    for ref in refs:
        key = (None, ref.name, None, OTHER)
        if key not in units:
            units[key] = tensor_unit(ref)
    return units


def header_tensors(ck: Checkpoint, skip: set[str]) -> list[TensorRef]:
    """The tensors of every safetensors file of `ck` but those in `skip` (a container's layer files), in file
    name order, each header read through the one reader."""
    from trellis_cli.checkpoint.reader import shard_header

    refs: list[TensorRef] = []
    for name in sorted(ck.files):
        if name.endswith(".safetensors") and name not in skip and ck.files[name] >= 0:
            header = shard_header(ck, name)
            refs += [TensorRef(e.name, name, e.dtype, tuple(e.shape), e.begin, e.end, header.data_start)
                     for e in header.tensors.values()]
    return refs


# ---- rearranged in memory, one (layer, rank) at a time -----------------------------------------------------

def pack_units(pack: "LayerPack") -> dict[Key, Unit]:
    """The units of one LayerPack, each with the sha256 of its bytes."""
    from trellis_cli.checkpoint.tensor_bytes import byte_view

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
                "I16", native_shape(proj, pack.hidden, pack.intermediate, k), byte_view(codes))
            inter = pack.rot_intermediate[combined, p].contiguous()
            units[expert, proj, pack.rank, INTERMEDIATE] = _memory_unit("F16", (pack.intermediate,), byte_view(inter))
            table = tables[p]
            row = table[combined if table.shape[0] > 1 else 0].contiguous()
            units[expert, proj, pack.rank, HIDDEN] = _memory_unit("F16", (pack.hidden,), byte_view(row))
    return units


def _memory_unit(dtype: str, shape: tuple[int, ...], data: memoryview) -> Unit:
    return Unit(dtype, shape, data.nbytes, None, hashlib.sha256(data).hexdigest())
