"""The routed-expert linears named in one header, read from its names alone: one regex split of the names (joined
by line breaks) reads every name of the form `model.layers.L.mlp.experts.E.{gate,up,down}_proj[.rankR].{field}`
(ids canonical and short, field one of the EXL3 linear fields) into columns of positions, which the bulk build of
the layers (`dialects/bulk_layers.py`) turns into records. A pure function of the names: a scan worker may compute
it beside the header's own columns (`checkpoint/reader.py`), so the opening's parent does not split them again.
Names that are all linears' fields (a layer shard's) are read in bulk instead (`_bulk_linears`: numpy on the dots'
positions, each distinct layer, expert and projection-rank-field text matched once); the split stays the reference,
and decides every other header.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from trellis_cli.checkpoint.columns import all_distinct
from trellis_cli.checkpoint.names import LINEAR_FIELDS, LINEAR_NAME, LINEAR_PREFIX
from trellis_cli.header_layout import all_at, distinct_spans

# Ids of at most 5 (layer), 6 (expert) and 4 (rank) digits keep a linear's key inside int64; a longer id is
# left to the per-tensor path.
_LAYER = r"(0|[1-9][0-9]{0,4})"
_EXPERT = r"(0|[1-9][0-9]{0,5})"
_PROJECTION_FIELD = r"(gate|up|down)_proj(?:\.rank(0|[1-9][0-9]{0,3}))?\.(trellis|suh|svh|su|sv|mcg|mul1)"
_CANONICAL_LINEAR = re.compile(r"^model\.layers\." + _LAYER + r"\.mlp\.experts\." + _EXPERT + r"\." + _PROJECTION_FIELD + "$",
                               re.MULTILINE)
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


def name_linears(text: str, count: int, sep: str = "\n") -> NameLinears | None:
    """The linears of a header whose `count` names, in stored order, are `text` joined by `sep` (a line break, or
    the quote a canonical header's columns join them by: no such name holds one); None where the bulk build cannot
    prove it gives the per-tensor build's records: a non-ASCII name (it may read as an expert's once normalized), a
    name with a line break or `sep`, a name under `.mlp.experts.` that the per-tensor build would join to a linear (an
    alias, a rank-less spelling beside a ranked one, an extra field), a field twice."""
    if not count:
        return _NONE
    if not text.isascii() or text.count(sep) != count - 1:
        return None
    if ".mlp.experts." not in text:
        return _NONE
    bulk = _bulk_linears(text, count, sep)
    if bulk is not None:
        return bulk
    if sep != "\n":  # the reference reads names by lines
        if "\n" in text:
            return None
        text = text.replace(sep, "\n")
    return _split_linears(text, count)


def _split_linears(text: str, count: int) -> NameLinears | None:
    """`name_linears` by one split of the names by the linear's pattern, a match per name: the reference."""
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
    return _linears(at, (layer, expert, projection, rank), field, not rankless, np.array(others, dtype=np.int32))


def _linears(at: np.ndarray, ids: tuple[np.ndarray, ...], field: np.ndarray, sliced: bool,
             others: np.ndarray) -> NameLinears | None:
    """The NameLinears of the linears' names at positions `at`, given each one's layer, expert, projection code and
    rank (`ids`) and field code; None where a linear holds a field twice."""
    layer, expert, projection, rank = ids
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
    return NameLinears(unique[order], sliced, columns, others)


# A linear's name in its pieces (`model.layers.`, its layer, `.mlp.experts.`, its expert, then its projection, rank
# and field): the bulk read matches each distinct piece once.
_BEFORE_LAYER = b"model.layers."
_BEFORE_EXPERT = b".mlp.experts."
_LAYER_TEXT = re.compile(_LAYER)
_EXPERT_TEXT = re.compile(_EXPERT)
_PROJECTION_FIELD_TEXT = re.compile(_PROJECTION_FIELD)


def _bulk_linears(text: str, count: int, sep: str = "\n") -> NameLinears | None:
    """`name_linears` of names (ASCII, joined by `count - 1` of `sep`) that are all linears' fields, all with a rank
    or all without, read in bulk instead of a match per name: each name then has a fixed count of `.`-separated
    parts, `model.layers.` before them and `.mlp.experts.` after the layer, and each distinct layer, expert and
    `P_proj[.rankR].F` text is matched once by its part of _CANONICAL_LINEAR. The reference (`_split_linears`) matches
    each such name whole, so the columns are equal. None wherever that is not proven (a zero byte, another name,
    another count of parts): the reference decides."""
    if "\0" in text:
        return None
    data = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    breaks = np.flatnonzero((data == ord(".")) | (data == ord(sep)))
    parts, rest = divmod(len(breaks) + 1, count)
    if rest or parts not in (8, 9):  # model.layers.L.mlp.experts.E.P_proj[.rankR].F
        return None
    flat = np.empty(count * parts, dtype=np.int64)  # the break before each part (-1 before the first)
    flat[0], flat[1:] = -1, breaks
    before = flat.reshape(count, parts)
    ends = np.append(before[1:, 0], len(data))  # each name's end
    # (the caller counted count - 1 of `sep`: those before each name but the first, the others dots)
    if not (bool((data[before[1:, 0]] == ord(sep)).all()) and all_at(data, before[:, 0] + 1, _BEFORE_LAYER)
            and all_at(data, before[:, 3], _BEFORE_EXPERT)):
        return None
    layer = _groups(text, data, before[:, 2] + 1, before[:, 3], 8, _LAYER_TEXT)
    expert = _groups(text, data, before[:, 5] + 1, before[:, 6], 8, _EXPERT_TEXT)
    rest_ids = _groups(text, data, before[:, 6] + 1, ends, 32, _PROJECTION_FIELD_TEXT)
    if layer is None or expert is None or rest_ids is None:
        return None
    projection, rank, field = rest_ids
    return _linears(np.arange(count), (*layer, *expert, projection, rank), field, parts == 9,
                    np.zeros(0, dtype=np.int32))


def _groups(text: str, data: np.ndarray, begins: np.ndarray, ends: np.ndarray, width: int,
            pattern: re.Pattern[str]) -> list[np.ndarray] | None:
    """Each group of `pattern` in the spans `text[begins[i]:ends[i]]` as a column of codes (a number's value, a
    projection's or field's code, 0 for an absent rank), `pattern` matched once per distinct span; None where one
    does not match."""
    distinct = distinct_spans(data, begins, ends, width)
    if distinct is None:
        return None
    first, position = distinct
    rows = []
    for at in first.tolist():
        match = pattern.fullmatch(text, int(begins[at]), int(ends[at]))
        if match is None:
            return None
        rows.append([_CODES[group] if group in _CODES else int(group or 0) for group in match.groups()])
    return list(np.array(rows, dtype=np.int64)[position].T)


_CODES = {**_PROJECTION_CODE, **_FIELD_CODE}


def _joins_a_linear(name: str) -> bool:
    """Whether the per-tensor build reads `name` as a field of a linear (`open._build_layers`)."""
    prefix, _, field = name.rpartition(".")
    if field in LINEAR_FIELDS:
        return LINEAR_PREFIX.fullmatch(prefix) is not None
    return LINEAR_NAME.match(name) is not None


def _ints(texts: list[str]) -> np.ndarray:
    return np.fromstring(" ".join(texts), dtype=np.int64, sep=" ")


__all__ = ["EXPERTS", "FIELDS", "NameLinears", "RANKS", "name_linears"]
