"""A MoE layer's linears as flat columns, for the rules that read every linear of a layer (~3k per layer, ~233k at
production size): validate's tensor, marker and engine rules and inspect's layer rows each walked the nested
expert -> projection -> rank dicts with a Python step per linear, several times per layer. Here the linears are
listed once, in that same walk order, and each field is one list built in C, so a rule proves the common case
(nothing wrong) with a few C passes and walks one linear at a time only where something is.

`shared()` keeps each layer's columns for the duration of one command (validate's rules, inspect's document), so
the rules that ask share one build; outside it every call builds afresh (the layer may have changed since).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Iterable, Iterator

import numpy as np

from trellis_cli.checkpoint.model import LinearRef, MoeLayer, TensorRef

# LinearRef's fields by position: the seven tensors, then the extra fields
TRELLIS, SUH, SVH, SU, SV, MCG, MUL1, EXTRA = range(8)
TENSOR_FIELDS = range(TRELLIS, EXTRA)
_GET = {i: itemgetter(i) for i in range(8)}

_MEMO: ContextVar[_Shared | None] = ContextVar("layer_columns", default=None)


class _Shared:
    """The columns of the layers asked for within one `shared()` block. Each layer's facts (its K per expert,
    layout, bytes per rank) are kept for the whole block; its field columns only while it is the layer being read:
    the rules read one layer at a time, and every layer's columns held at once were ~18 MB at production size."""

    def __init__(self) -> None:
        self.built: dict[int, LayerColumns] = {}
        self.current: LayerColumns | None = None

    def columns(self, layer: MoeLayer) -> LayerColumns:
        found = self.built.get(id(layer))
        if found is None or found.layer is not layer:
            found = self.built[id(layer)] = LayerColumns(layer)
        if self.current is not found:
            if self.current is not None:
                self.current.drop_fields()
            self.current = found
        return found


@contextmanager
def shared() -> Iterator[None]:
    """Within this block each layer's facts are computed once (the layers are read, not changed, meanwhile)."""
    token = _MEMO.set(_Shared())
    try:
        yield
    finally:
        _MEMO.reset(token)


def columns(layer: MoeLayer) -> LayerColumns:
    """The layer's columns: the shared build inside `shared()`, else a new one."""
    memo = _MEMO.get()
    return LayerColumns(layer) if memo is None else memo.columns(layer)


def _k(shape: tuple[int, ...] | None) -> int | None:
    """LinearRef.k of a trellis of this shape (None: no trellis)."""
    return None if shape is None or len(shape) != 3 or shape[2] % 16 else shape[2] // 16


class LayerColumns:
    """The linears of one layer in walk order (expert, then projection, then rank, as the dicts hold them) and
    each field as a column; the K facts of every expert, computed once."""

    def __init__(self, layer: MoeLayer) -> None:
        self.layer = layer
        self.linears: list[LinearRef] = list(chain.from_iterable(
            map(dict.values, chain.from_iterable(map(dict.values, layer.experts.values())))))
        self._fields: dict[int, list] = {}
        self._expert_ks: dict[int, frozenset[int | None]] | None = None
        self._partition: dict[int, list[int]] | None = None
        self._layout: tuple[tuple[str, ...], tuple[int, ...]] | bool | None = None
        self._rank_bytes: dict[int, list[int]] = {}
        self._present: dict[int, int] = {}

    def field(self, i: int) -> list:
        """Column `i` of every linear (TRELLIS ... MUL1: a TensorRef or None; EXTRA: a tuple)."""
        found = self._fields.get(i)
        if found is None:
            found = self._fields[i] = list(map(_GET[i], self.linears))
        return found

    def drop_fields(self) -> None:
        """Free the field columns (built again when asked); the facts computed from them are kept."""
        self._fields.clear()

    def present(self, i: int) -> int:
        """How many linears have field `i`."""
        found = self._present.get(i)
        if found is None:
            found = self._present[i] = len(self.linears) - self.field(i).count(None)
        return found

    def tensors_held(self) -> int:
        """How many tensors the linears hold: each present field and each extra one (the sum of `present` over
        TENSOR_FIELDS and of the extra fields' lengths), counted over the records flattened once, not a column per
        field."""
        flat: list[Any] = list(chain.from_iterable(self.linears))  # (each record: EXTRA tensor fields, its extra tuple)
        return EXTRA * len(self.linears) - flat.count(None) + sum(map(len, flat[EXTRA::EXTRA + 1]))

    def expert_ks(self) -> dict[int, frozenset[int | None]]:
        """expert -> the K of each of its linears, as a set (None for a linear whose trellis shape says none)."""
        if self._expert_ks is None:
            layout = self.layout()
            if layout is not None:  # each expert a run of `period` linears: a row each, its K where min == max
                period = len(layout[0]) * len(layout[1])
                codes = np.array([_NO_K if k is None else k for k in self.linear_ks()], dtype=np.int64)
                rows = codes.reshape(-1, period)
                low, high = rows.min(axis=1).tolist(), rows.max(axis=1).tolist()
                one = {k: frozenset((None if k == _NO_K else k,)) for k in set(low)}  # shared by its experts
                mixed = rows.tolist() if low != high else []
                runs: Iterable[frozenset[int | None]] = [
                    one[lo] if lo == hi else frozenset(None if k == _NO_K else k for k in mixed[e])
                    for e, (lo, hi) in enumerate(zip(low, high))]
            else:
                runs = (frozenset(_k(None if t is None else t.shape) for by_rank in projs.values()
                                  for t in map(_GET[TRELLIS], by_rank.values()))
                        for projs in self.layer.experts.values())
            self._expert_ks = dict(zip(self.layer.experts, runs))
        return self._expert_ks

    def linear_ks(self) -> list[int | None]:
        """The K of each linear, in walk order (LinearRef.k)."""
        shapes = [None if t is None else t.shape for t in self.field(TRELLIS)]
        k_of = {shape: _k(shape) for shape in set(shapes)}
        return list(map(k_of.__getitem__, shapes))

    def expert_k(self, expert: int) -> int | None:
        """MoeLayer.expert_k: the one K of all the expert's linears, else None."""
        ks = self.expert_ks().get(expert, frozenset())
        return next(iter(ks)) if len(ks) == 1 else None

    def every_expert_one_k(self) -> bool:
        """Whether `expert_k` is an int for every expert of the layer."""
        return all(len(ks) == 1 and None not in ks for ks in self.expert_ks().values())

    def partition(self) -> dict[int, list[int]]:
        """MoeLayer.partition: K -> sorted expert ids (experts whose linears disagree are left out)."""
        if self._partition is None:
            tiers: dict[int, list[int]] = {}
            for e, ks in sorted(self.expert_ks().items()):
                if len(ks) == 1:
                    k = next(iter(ks))
                    if k is not None:
                        tiers.setdefault(k, []).append(e)
            self._partition = dict(sorted(tiers.items()))
        return self._partition

    def rank_bytes(self, i: int) -> list[int]:
        """Field `i`'s bytes summed per rank, in `layout`'s rank order (needs `layout`): a rank's linears are
        every len(ranks)-th of a column."""
        found = self._rank_bytes.get(i)
        if found is None:
            layout = self.layout()
            assert layout is not None
            step, column, present = len(layout[1]), self.field(i), self.present(i)
            if not present:
                found = [0] * step
            elif present == len(column):  # no None to leave out
                found = [_bytes(column[at::step]) for at in range(step)]
            else:
                found = [_bytes(list(filter(None, column[at::step]))) for at in range(step)]
            self._rank_bytes[i] = found
        return found

    def layout(self) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        """(projections, ranks) when every expert holds the same projections in the same order and each of them
        the same ranks in the same order (a column is then periodic: see `projection_field`); else None."""
        if self._layout is None:
            experts = self.layer.experts.values()
            projs = set(map(tuple, experts))
            ranks = set(map(tuple, chain.from_iterable(map(dict.values, experts))))
            self._layout = (projs.pop(), ranks.pop()) if len(projs) == 1 and len(ranks) == 1 else False
        return self._layout if isinstance(self._layout, tuple) else None

    def field_kinds(self, i: int, proj: str) -> list[TensorRef | None] | None:
        """`kinds` of field `i` in one projection's linears (needs `layout`); a field no linear has is not split."""
        return [None] if not self.present(i) else kinds(self.projection_field(i, proj))

    def projection_field(self, i: int, proj: str) -> list:
        """Column `i` of one projection's linears, every expert and rank (needs `layout`)."""
        layout = self.layout()
        assert layout is not None
        projs, ranks = layout
        period, first = len(projs) * len(ranks), projs.index(proj) * len(ranks)
        column = self.field(i)
        return list(chain.from_iterable(column[first + r::period] for r in range(len(ranks))))


def kinds(refs: list[TensorRef | None]) -> list[TensorRef | None] | None:
    """One stand-in per (dtype, shape) a field can take in `refs` (None among them where a linear lacks it), or
    None where there are too many to try: dtype and shape are collected apart, so the stand-ins are every
    pairing of the two (a superset of the kinds present)."""
    present = list(filter(None, refs))
    dtypes = set(map(_DTYPE, present))
    shapes = set(map(_SHAPE, present))
    if len(dtypes) * len(shapes) > MAX_KINDS:
        return None
    out: list[TensorRef | None] = [TensorRef("", "", d, s, 0, 0, 0) for d in dtypes for s in shapes]
    if len(present) < len(refs):
        out.append(None)
    return out


MAX_KINDS = 16
_NO_K = -1  # a linear whose trellis shape says no K, in an array of Ks
_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")
_BEGIN, _END = attrgetter("begin"), attrgetter("end")


def _bytes(refs: list[TensorRef]) -> int:
    """The bytes of `refs`, summed in C."""
    return sum(map(_END, refs)) - sum(map(_BEGIN, refs))
