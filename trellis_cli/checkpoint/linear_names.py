"""The routed-expert linears named in one header, read from its names alone: one regex split of the names (joined
by line breaks) reads every name of the form `model.layers.L.mlp.experts.E.{gate,up,down}_proj[.rankR].{field}`
(ids canonical and short, field one of the EXL3 linear fields) into columns of positions, which the bulk build of
the layers (`dialects/bulk_layers.py`) turns into records. A pure function of the names: a scan worker may compute
it beside the header's own columns (`checkpoint/reader.py`), so the opening's parent does not split them again.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from trellis_cli.checkpoint.columns import all_distinct
from trellis_cli.checkpoint.names import LINEAR_FIELDS, LINEAR_NAME, LINEAR_PREFIX

# Ids of at most 5 (layer), 6 (expert) and 4 (rank) digits keep a linear's key inside int64; a longer id is
# left to the per-tensor path.
_CANONICAL_LINEAR = re.compile(
    r"^model\.layers\.(0|[1-9][0-9]{0,4})\.mlp\.experts\.(0|[1-9][0-9]{0,5})\.(gate|up|down)_proj"
    r"(?:\.rank(0|[1-9][0-9]{0,3}))?\.(trellis|suh|svh|su|sv|mcg|mul1)$", re.MULTILINE)
_GROUPS = 5
_PROJECTION_CODE = {"gate": 0, "up": 1, "down": 2}
FIELDS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")  # LinearRef's order
_FIELD_CODE = {name: code for code, name in enumerate(FIELDS)}
assert set(FIELDS) == LINEAR_FIELDS
EXPERTS, RANKS = 1_000_000, 10_000  # a linear's key: ((layer * EXPERTS + expert) * 3 + projection) * RANKS + rank


class NameLinears(NamedTuple):
    """One header's linears in the order their first field is stored, as positions in its names: the key of each
    (its layer, expert, projection code and rank), whether the names carry ranks, for each field (FIELDS' order)
    the position of each linear's tensor of that field (-1: none), and the positions of the header's other names
    under `.mlp.experts.` (the per-tensor path's own), in stored order."""

    keys: np.ndarray  # int64 per linear
    sliced: bool
    fields: np.ndarray  # int32, a row per field (positions: a header lists at most 2^18 tensors)
    others: np.ndarray  # int32


_NONE = NameLinears(np.zeros(0, dtype=np.int64), False, np.zeros((len(FIELDS), 0), dtype=np.int32),
                    np.zeros(0, dtype=np.int32))


def name_linears(text: str, count: int) -> NameLinears | None:
    """The linears of a header whose `count` names, in stored order, are `text` joined by line breaks; None where
    the bulk build cannot prove it gives the per-tensor build's records: a non-ASCII name (it may read as an
    expert's once normalized), a name with a line break, a name under `.mlp.experts.` that the per-tensor build
    would join to a linear (an alias, a rank-less spelling beside a ranked one, an extra field), a field twice."""
    if not count:
        return _NONE
    if not text.isascii() or text.count("\n") != count - 1:
        return None
    if ".mlp.experts." not in text:
        return _NONE
    parts = _CANONICAL_LINEAR.split(text)
    gaps = parts[::_GROUPS + 1]
    matched = len(gaps) - 1
    others: list[int] = []
    if matched == count:
        at = np.arange(matched)
    else:  # other tensors between the linears' fields: each match's line from the line breaks before it
        at = np.cumsum([gap.count("\n") for gap in gaps[:-1]], dtype=np.int64)
        taken = set(at.tolist())
        for i, name in enumerate(text.split("\n")):
            if i not in taken and ".mlp.experts." in name:
                if _joins_a_linear(name):
                    return None
                others.append(i)
    if not matched:
        return _NONE._replace(others=np.array(others, dtype=np.int32))
    ranks_text = parts[4::_GROUPS + 1]
    rankless = ranks_text.count(None)
    if rankless not in (0, matched):
        return None  # ranked and rank-less names in one shard: rank 0 may be spelled twice
    layer = _ints(parts[1::_GROUPS + 1])
    expert = _ints(parts[2::_GROUPS + 1])
    rank = np.zeros(matched, dtype=np.int64) if rankless else _ints(ranks_text)
    projection = np.fromiter(map(_PROJECTION_CODE.__getitem__, parts[3::_GROUPS + 1]), dtype=np.int64, count=matched)
    field = np.fromiter(map(_FIELD_CODE.__getitem__, parts[5::_GROUPS + 1]), dtype=np.int64, count=matched)
    key = ((layer * EXPERTS + expert) * 3 + projection) * RANKS + rank
    if not all_distinct(key * len(FIELDS) + field):
        return None
    unique, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # linears in the order their first field is stored
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    linear_of = position[inverse]
    columns = np.full((len(FIELDS), order.size), -1, dtype=np.int32)
    columns[field, linear_of] = at
    return NameLinears(unique[order], not rankless, columns, np.array(others, dtype=np.int32))


def _joins_a_linear(name: str) -> bool:
    """Whether the per-tensor build reads `name` as a field of a linear (`open._build_layers`)."""
    prefix, _, field = name.rpartition(".")
    if field in LINEAR_FIELDS:
        return LINEAR_PREFIX.fullmatch(prefix) is not None
    return LINEAR_NAME.match(name) is not None


def _ints(texts: list[str]) -> np.ndarray:
    return np.fromstring(" ".join(texts), dtype=np.int64, sep=" ")


__all__ = ["EXPERTS", "FIELDS", "NameLinears", "RANKS", "name_linears"]
