"""The MoE layers of a checkpoint whose routed-expert linears are canonically named, built header by header in
bulk: what `open._build_layers` builds tensor by tensor, without a Python step per tensor (a production
checkpoint has ~935k).

One regex split of a header's names (`checkpoint/linear_names.py`, done by a scan worker where the opening's
headers were read in workers) reads every name of the form `model.layers.L.mlp.experts.E.{gate,up,down}_proj
[.rankR].{field}` (ids canonical and short, field one of the EXL3 linear fields) into columns; numpy groups them
into linears in the order their first field is stored, and the records are made here by `map` over those
columns. Every other name under `.mlp.experts.` is the per-tensor path's own (`open._add_other_expert_tensor`),
called in stored order, unless it would join a linear (an alias, a rank-less spelling beside a ranked one, an
extra field): then the bulk build declines, as it does for a linear split over two shards, a name twice, or a
non-ASCII name, and the per-tensor path builds everything. Tests hold both builds equal, records and order,
on good and damaged checkpoints.
"""

from __future__ import annotations

from itertools import repeat
from typing import Callable, Mapping, NamedTuple

import numpy as np

from trellis_cli.checkpoint.columns import all_distinct
from trellis_cli.checkpoint.linear_names import EXPERTS, FIELDS, RANKS, NameLinears, name_linears
from trellis_cli.checkpoint.model import Checkpoint, LinearRef, MoeLayer, TensorRef
from trellis_cli.header_records import Header

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _HeaderLinears(NamedTuple):
    """One header's linears in the order their first field is stored: the key of each (its layer, expert,
    projection code and rank: `_ids`), the file, the records, and whether the names carry ranks."""

    file: str
    keys: np.ndarray  # int64 key per linear
    sliced: bool
    records: list[LinearRef]


def build_layers_in_bulk(ckpt: Checkpoint, other_expert_tensor: Callable[[Checkpoint, str, TensorRef], None],
                         split: Mapping[str, NameLinears | None] | None = None) -> bool:
    """Fill `ckpt.layers` as the per-tensor build does, and True; False (nothing changed) where this build cannot
    prove it would give the same records in the same order. `split`: the `name_linears` of headers whose names a
    scan worker split already (`reader.read_headers`); the others' names are split here."""
    files = sorted(ckpt.headers)
    if len(ckpt.tensors) != sum(len(ckpt.headers[file].tensors) for file in files):
        return False  # a name in several files: the model's tensors are not the headers' concatenation
    split = split or {}
    built: list[_HeaderLinears] = []
    others: list[tuple[str, TensorRef]] = []
    for file in files:
        header = ckpt.headers[file]  # (its entries placed in the listed file by `open._collect_tensors`)
        found = _split(split, file, header)
        if found is None:
            return False
        if not found.keys.size and not found.others.size:
            continue
        refs = list(header.tensors.values())
        others.extend((refs[i].name, refs[i]) for i in found.others.tolist())
        built.append(_header_linears(file, refs, found))
    if built and not all_distinct(np.concatenate([b.keys for b in built])):
        return False  # a linear with fields in two shards
    for name, ref in others:
        other_expert_tensor(ckpt, name, ref)
    layers = ckpt.layers
    for b in built:
        _place(layers, b)
    ckpt.layers = dict(sorted(layers.items()))
    return True


class LayersAsRead:
    """The bulk build header by header, as the opening reads them (`add`, while the scan workers read the next
    shards), then `finish`: the same layers as `build_layers_in_bulk`, where every header came in sorted file order,
    under its own name, with no name in two files and no other expert tensor (whose path runs before any linear is
    placed); else `finish` gives False and the opening builds them after the reading, as without it."""

    def __init__(self) -> None:
        self.layers: dict[int, MoeLayer] = {}
        self.files: list[str] = []
        self.keys: list[np.ndarray] = []
        self.named = True  # every header so far under its own name, its names split
        self.whole = True  # and none with another expert tensor: its linears placed
        # file -> (the layers its linears are of, the positions of its names that are no linear's field), for each
        # header holding a linear: where the names of the model's `TensorMap` are (`named_apart`)
        self.linears_of: dict[str, tuple[list[int], np.ndarray]] = {}

    def add(self, file: str, header: Header, split: Mapping[str, NameLinears | None]) -> None:
        if not self.named:
            return
        found = _split(split, file, header)
        if found is None or header.file != file:
            self.named = self.whole = False
            self.layers, self.keys, self.linears_of = {}, [], {}
            return
        self.files.append(file)
        if found.keys.size:
            self.keys.append(found.keys)
            self.linears_of[file] = (np.unique(found.keys // (EXPERTS * 3 * RANKS)).tolist(),
                                     _not_fields(found, len(header.tensors)))
        if found.others.size:
            self.whole, self.layers = False, {}
        if self.whole and found.keys.size:
            _place(self.layers, _header_linears(file, list(header.tensors.values()), found))

    def named_apart(self, files: list[str]) -> bool:
        """Whether every header of `files` (sorted) was added with its names split, and no linear has fields in two
        of them: then each name that is a linear's field is in one header only (a canonical name is its linear's
        key and field)."""
        if not self.named or self.files != files:
            return False
        return not self.keys or all_distinct(np.concatenate(self.keys))

    def finish(self, ckpt: Checkpoint) -> bool:
        """Fill `ckpt.layers` from what was added, and True, where that is `build_layers_in_bulk`'s answer."""
        files = sorted(ckpt.headers)
        if not self.whole or len(ckpt.tensors) != sum(len(ckpt.headers[file].tensors) for file in files) or \
                not self.named_apart(files):
            return False
        ckpt.layers = dict(sorted(self.layers.items()))
        return True


def _split(split: Mapping[str, NameLinears | None], file: str, header: Header) -> NameLinears | None:
    """The header's names split into linears: by a scan worker, where one read it, else here."""
    return split[file] if file in split else name_linears("\n".join(header.tensors), len(header.tensors))


def _not_fields(found: NameLinears, count: int) -> np.ndarray:
    """The positions of a header's `count` names that are no linear's field, in stored order."""
    fields = found.fields[found.fields >= 0]
    if len(fields) == count:
        return fields[:0]
    return np.setdiff1d(np.arange(count, dtype=fields.dtype), fields)


def _header_linears(file: str, refs: list[TensorRef], found: NameLinears) -> _HeaderLinears:
    """The records of one header's linears, from the positions of their fields in its names."""
    if not found.keys.size:
        return _HeaderLinears(file, found.keys, False, [])  # (other expert tensors only)
    with_none = refs + [None]
    columns = [list(map(with_none.__getitem__, column.tolist())) for column in found.fields]
    records = list(map(tuple.__new__, repeat(LinearRef), zip(*columns, repeat(()))))
    return _HeaderLinears(file, found.keys, found.sliced, records)


def _ids(keys: np.ndarray) -> tuple[list[int], list[int], list[int], list[int]]:
    """(layers, experts, projection codes, ranks) of linears' keys: read from the keys when the linears are placed,
    not held beside them while every header is read (~7 MB at production size)."""
    rest, rank = np.divmod(keys, RANKS)
    rest, projection = np.divmod(rest, 3)
    layer, expert = np.divmod(rest, EXPERTS)
    return layer.tolist(), expert.tolist(), projection.tolist(), rank.tolist()


def _place(layers: dict[int, MoeLayer], b: _HeaderLinears) -> None:
    """The header's linears into their layers' experts, in order (as the per-tensor build inserts them). A run of
    linears of one projection of one expert (its ranks, stored together) is inserted by one update: the same
    dicts in the same order as one insert per linear."""
    if not b.records:
        return
    group = b.keys // RANKS  # (layer, expert, projection)
    starts = [0, *(np.flatnonzero(group[1:] != group[:-1]) + 1).tolist()]
    ends = starts[1:] + [len(b.records)]
    seen: set[int] = set()
    ranks = (b.keys % RANKS).tolist()
    for li, expert, proj, _rank, start, end in zip(*_ids(b.keys[starts]), starts, ends):
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
        by_proj.update(zip(ranks[start:end], b.records[start:end]))


__all__ = ["LayersAsRead", "build_layers_in_bulk"]
