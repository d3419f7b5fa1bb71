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

from trellis_cli.checkpoint import layer_columns
from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, TensorRef
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


def _vector(ref: TensorRef) -> Unit:
    return Unit(ref.dtype, (math.prod(ref.shape),), ref.nbytes, span_of(ref))


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
        others = [ref for name, ref in ck.tensors.items() if ".mlp.experts." not in name]
        if _held(ck) == len(ck.tensors) - len(others):
            return named_units(others)
    consumed = expert_tensor_names(ck)
    return named_units(ref for name, ref in ck.tensors.items() if name not in consumed)


def _held(ck: Checkpoint) -> int:
    """How many tensors the MoE layers hold (codes, vectors, markers, extra fields, shared rows, unparsed)."""
    held = 0
    for moe in ck.layers.values():
        cols = layer_columns.columns(moe)
        held += sum(map(cols.present, layer_columns.TENSOR_FIELDS)) + sum(map(len, cols.field(layer_columns.EXTRA)))
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
