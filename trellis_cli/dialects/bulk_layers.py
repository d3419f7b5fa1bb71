"""The MoE layers of a checkpoint whose routed-expert linears are canonically named, built header by header in
bulk: what `open._build_layers` builds tensor by tensor, without a Python step per tensor (a production
checkpoint has ~935k).

One regex split of a header's names (joined by line breaks) reads every name of the form
`model.layers.L.mlp.experts.E.{gate,up,down}_proj[.rankR].{field}` (ids canonical and short, field one of the
EXL3 linear fields) into columns; numpy groups them into linears in the order their first field is stored,
and the records are made by `map` over those columns. Every other name under `.mlp.experts.` is the
per-tensor path's own (`open._add_other_expert_tensor`), called in stored order, unless it would join a linear
(an alias, a rank-less spelling beside a ranked one, an extra field): then the bulk build declines, as it does
for a linear split over two shards, a name twice, or a non-ASCII name, and the per-tensor path builds
everything. Tests hold both builds equal, records and order, on good and damaged checkpoints.
"""

from __future__ import annotations

import re
from itertools import repeat
from typing import Callable, NamedTuple

import numpy as np

from trellis_cli.checkpoint.columns import all_distinct
from trellis_cli.checkpoint.model import Checkpoint, LinearRef, MoeLayer, TensorRef
from trellis_cli.checkpoint.names import LINEAR_FIELDS, LINEAR_NAME, LINEAR_PREFIX

# Ids of at most 5 (layer), 6 (expert) and 4 (rank) digits keep a linear's key inside int64; a longer id is
# left to the per-tensor path.
_CANONICAL_LINEAR = re.compile(
    r"^model\.layers\.(0|[1-9][0-9]{0,4})\.mlp\.experts\.(0|[1-9][0-9]{0,5})\.(gate|up|down)_proj"
    r"(?:\.rank(0|[1-9][0-9]{0,3}))?\.(trellis|suh|svh|su|sv|mcg|mul1)$", re.MULTILINE)
_GROUPS = 5
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_PROJECTION_CODE = {"gate": 0, "up": 1, "down": 2}
_FIELDS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")  # LinearRef's order
_FIELD_CODE = {name: code for code, name in enumerate(_FIELDS)}
assert set(_FIELDS) == LINEAR_FIELDS


class _HeaderLinears(NamedTuple):
    """One header's linears in the order their first field is stored: the key of each (its layer, expert,
    projection code and rank: `_ids`), the file, the records, and whether the names carry ranks."""

    file: str
    keys: np.ndarray  # int64 key per linear
    sliced: bool
    records: list[LinearRef]


def build_layers_in_bulk(ckpt: Checkpoint, other_expert_tensor: Callable[[Checkpoint, str, TensorRef], None]) -> bool:
    """Fill `ckpt.layers` as the per-tensor build does, and True; False (nothing changed) where this build cannot
    prove it would give the same records in the same order."""
    files = sorted(ckpt.headers)
    if len(ckpt.tensors) != sum(len(ckpt.headers[file].tensors) for file in files):
        return False  # a name in several files: the model's tensors are not the headers' concatenation
    built: list[_HeaderLinears] = []
    others: list[tuple[str, TensorRef]] = []
    for file in files:
        header = ckpt.headers[file]  # (its entries placed in the listed file by `open._collect_tensors`)
        names = list(header.tensors)
        if not names:
            continue
        text = "\n".join(names)
        if not text.isascii() or text.count("\n") != len(names) - 1:
            return False  # (a non-ASCII name may read as an expert's once normalized; a name with a line break)
        if ".mlp.experts." not in text:
            continue
        found = _header_linears(file, names, list(header.tensors.values()), text, others)
        if found is None:
            return False
        built.append(found)
    if built and not all_distinct(np.concatenate([b.keys for b in built])):
        return False  # a linear with fields in two shards
    for name, ref in others:
        other_expert_tensor(ckpt, name, ref)
    layers = ckpt.layers
    for b in built:
        _place(layers, b)
    ckpt.layers = dict(sorted(layers.items()))
    return True


def _header_linears(file: str, names: list[str], refs: list[TensorRef], text: str,
                    others: list[tuple[str, TensorRef]]) -> _HeaderLinears | None:
    parts = _CANONICAL_LINEAR.split(text)
    gaps = parts[::_GROUPS + 1]
    matched = len(gaps) - 1
    if matched == len(names):
        at = np.arange(matched)
    else:  # other tensors between the linears' fields: each match's line from the line breaks before it
        at = np.cumsum([gap.count("\n") for gap in gaps[:-1]], dtype=np.int64)
        taken = set(at.tolist())
        for i, name in enumerate(names):
            if i not in taken and ".mlp.experts." in name:
                if _joins_a_linear(name):
                    return None
                others.append((name, refs[i]))
    if not matched:
        return _HeaderLinears(file, np.zeros(0, dtype=np.int64), False, [])
    ranks_text = parts[4::_GROUPS + 1]
    rankless = ranks_text.count(None)
    if rankless not in (0, matched):
        return None  # ranked and rank-less names in one shard: rank 0 may be spelled twice
    layer = _ints(parts[1::_GROUPS + 1])
    expert = _ints(parts[2::_GROUPS + 1])
    rank = np.zeros(matched, dtype=np.int64) if rankless else _ints(ranks_text)
    projection = np.fromiter(map(_PROJECTION_CODE.__getitem__, parts[3::_GROUPS + 1]), dtype=np.int64, count=matched)
    field = np.fromiter(map(_FIELD_CODE.__getitem__, parts[5::_GROUPS + 1]), dtype=np.int64, count=matched)
    key = ((layer * _EXPERTS + expert) * 3 + projection) * _RANKS + rank
    if not all_distinct(key * len(_FIELDS) + field):
        return None
    unique, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # linears in the order their first field is stored
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    linear_of = position[inverse]
    with_none = refs + [None]
    columns = []
    for code in range(len(_FIELDS)):
        chosen = field == code
        column = np.full(order.size, -1, dtype=np.int64)
        column[linear_of[chosen]] = at[chosen]
        columns.append(list(map(with_none.__getitem__, column.tolist())))
    records = list(map(tuple.__new__, repeat(LinearRef), zip(*columns, repeat(()))))
    return _HeaderLinears(file, unique[order], not rankless, records)


_EXPERTS, _RANKS = 1_000_000, 10_000  # a linear's key: ((layer * _EXPERTS + expert) * 3 + projection) * _RANKS + rank


def _ids(keys: np.ndarray) -> tuple[list[int], list[int], list[int], list[int]]:
    """(layers, experts, projection codes, ranks) of linears' keys: read from the keys when the linears are placed,
    not held beside them while every header is read (~7 MB at production size)."""
    rest, rank = np.divmod(keys, _RANKS)
    rest, projection = np.divmod(rest, 3)
    layer, expert = np.divmod(rest, _EXPERTS)
    return layer.tolist(), expert.tolist(), projection.tolist(), rank.tolist()


def _joins_a_linear(name: str) -> bool:
    """Whether the per-tensor build reads `name` as a field of a linear (`open._build_layers`)."""
    prefix, _, field = name.rpartition(".")
    if field in LINEAR_FIELDS:
        return LINEAR_PREFIX.fullmatch(prefix) is not None
    return LINEAR_NAME.match(name) is not None


def _place(layers: dict[int, MoeLayer], b: _HeaderLinears) -> None:
    """The header's linears into their layers' experts, in order (as the per-tensor build inserts them)."""
    seen: set[int] = set()
    for li, expert, proj, rank, record in zip(*_ids(b.keys), b.records):
        layer = layers.get(li)
        if layer is None:
            layer = layers[li] = MoeLayer(li)
        if li not in seen:
            seen.add(li)
            layer.files.add(b.file)
            if b.sliced:
                layer.rank_sliced = True
        by_expert = layer.experts.get(expert)
        if by_expert is None:
            by_expert = layer.experts[expert] = {}
        name = _PROJECTIONS[proj]
        by_proj = by_expert.get(name)
        if by_proj is None:
            by_proj = by_expert[name] = {}
        by_proj[rank] = record


def _ints(texts: list[str]) -> np.ndarray:
    return np.fromstring(" ".join(texts), dtype=np.int64, sep=" ")


__all__ = ["build_layers_in_bulk"]
