"""A rank-sliced shard's linears as columns, read from its raw header bytes: what `fit` needs of a production
TR3 (~935k tensors) without a record per tensor.

A shard whose header is in safetensors' own layout (`header_layout.canonical_entries`), ASCII, and whose every entry
is a field of a canonically spelled rank-sliced linear of one MoE layer
(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.rankR.{field}`) is read by one regex pass into arrays
(expert, projection, rank, field, begin, end) and summed with numpy: per (expert, rank) by the reference
(`ExpertColumns`), folded per (K, rank) for fit (`LinearColumns`: a few sums a shard rather than one per expert and
rank). Anything else (another spelling, a name twice, a reversed offset pair, tensors past the end of the file, a
shard mixing layers or other tensors) is `None`: the caller then opens the checkpoint in full, which words every
finding.

The regex pass is the reference; a production shard is first read without it (`header_layout.layout`, then
each name's parts as words, its ids' digits counted in them), which yields the same arrays wherever it proves every
name canonical, and leaves any header it cannot prove so to the regex; it sums them per (K, rank) in numpy, where
the regex's sums are folded so (`ExpertColumns.folded`).
"""

from __future__ import annotations

import re
from functools import partial
from itertools import compress
from typing import Callable, NamedTuple

import numpy as np

from trellis_cli.header_layout import (DIM_PATTERN, DTYPE_PATTERN, OFFSET_PATTERN, Layout, digits_at, layout,
                                       offset_pairs, short_uints, split_layout, word_of)
from trellis_cli.header_records import MAX_HEADER_TENSORS

# One entry of a linear's field, canonical ids only (as the names grammar reads them: checkpoint/names.py), in
# safetensors' own layout (header_layout.py: at most three dimensions of five digits, offsets below 10^18). The
# projection and the field are captured by their first one and three characters (fixed widths, joined and read by
# numpy).
_ID = rb"(0|[1-9][0-9]*)"
# (the whole name captured first, for the index's proof; the dtype matched among the known names, not captured; the
# offsets captured as one `begin,end` group)
_LINEAR_ENTRY = re.compile(
    rb'"(model\.layers\.(?:0|[1-9][0-9]*)\.mlp\.experts\.' + _ID + rb"\.(?=(.))(?:gate|up|down)_proj\.rank" + _ID +
    rb'\.(?=(...))(?:trellis|suh|svh|su|sv|mcg|mul1))":\{"dtype":"' + DTYPE_PATTERN + rb'","shape":\[(' + DIM_PATTERN +
    rb"(?:," + DIM_PATTERN + rb'){0,2})?\],"data_offsets":\[(' + OFFSET_PATTERN + b"," + OFFSET_PATTERN + rb")\]\}")
_GROUPS = 7
_EXPERT_LAYER = re.compile(rb'"model\.layers\.(0|[1-9][0-9]*)\.mlp\.experts\.')
_PROJECTION = np.full(256, -1, dtype=np.int64)
_PROJECTION[[ord("g"), ord("u"), ord("d")]] = [0, 1, 2]  # gate_proj, up_proj, down_proj
_FIELDS = sorted((name[:3] + b'"')[:3] for name in (b"trellis", b"suh", b"svh", b"su", b"sv", b"mcg", b"mul1"))
_FIELD_CODES = np.array([int.from_bytes(name, "big") for name in _FIELDS], dtype=np.int64)
_TRELLIS = _FIELDS.index(b"tre")
# Offsets whose sums stay exact in the float64 of np.bincount (a file of 4 PB is not a shard).
_EXACT = 1 << 52


class LinearColumns(NamedTuple):
    """One shard's rank-sliced linears as fit places them: its MoE layer; per (K, rank) the bytes of every field of
    the experts at that K (None: an expert whose linears have no one K, as `MoeLayer.expert_k` reads it) and how
    many gate_proj trellis tensors they hold, in the order the (expert, rank) pairs first reach each; its names,
    for the index's rebuilt proof."""

    layer: int
    tiers: dict[tuple[int | None, int], tuple[int, int]]  # (K or None, rank) -> (bytes, gate_proj trellis tensors)
    tensors: int
    # every tensor's name in header order after its layer's `prefix`, joined by `"`: canonical linear names, letters,
    # digits, `_` and `.` only (the names after the prefix are another layer's too, where the shards are alike)
    names: bytes

    @property
    def prefix(self) -> bytes:
        """What every name starts with: its MoE layer's experts."""
        return experts_prefix(self.layer)


def experts_prefix(layer: int) -> bytes:
    """What every routed-expert tensor name of a MoE layer starts with (at the start of each, nowhere else in a
    canonical linear's name)."""
    return b"model.layers.%d.mlp.experts." % layer


class ExpertColumns(NamedTuple):
    """The reference's sums of one shard's linears: per expert the lowest and highest K of its linears (-1 where a
    linear has no trellis, or one whose shape gives no K); per (expert, rank) the bytes of every field and how many
    gate_proj trellis tensors it holds."""

    layer: int
    k_range: dict[int, tuple[int, int]]
    ranks: dict[tuple[int, int], tuple[int, int]]  # (expert, rank) -> (bytes, gate_proj trellis tensors)
    names: bytes  # (whole, joined by `"`)

    def folded(self) -> LinearColumns:
        """The same sums per (K, rank): each expert's K where its linears have one (lowest and highest alike)."""
        return LinearColumns(self.layer, _fold(self.k_range, self.ranks), self.names.count(b'"') + 1,
                             self.names.replace(experts_prefix(self.layer), b""))


def _fold(k_range: dict[int, tuple[int, int]], ranks: dict[tuple[int, int], tuple[int, int]]
          ) -> dict[tuple[int | None, int], tuple[int, int]]:
    """`ExpertColumns.folded`'s sums."""
    tiers: dict[tuple[int | None, int], tuple[int, int]] = {}
    for (expert, rank), (nbytes, gates) in ranks.items():
        low, high = k_range[expert]
        key = (low if low == high and low >= 0 else None, rank)
        held = tiers.get(key, (0, 0))
        tiers[key] = (held[0] + nbytes, held[1] + gates)
    return tiers


def no_expert_tensors(raw: bytes) -> bool:
    """Whether a header's bytes name no routed-expert tensor at all (ASCII, no `.mlp.experts.` anywhere)."""
    return raw.isascii() and b".mlp.experts." not in raw


def linear_columns(raw: bytes, file_size: int) -> LinearColumns | None:
    """The columns of one raw header (the bytes after the length prefix) of a file of `file_size` bytes, or None
    where they would not be what the full opening reads (see the module docstring)."""
    found = layout(raw)
    fields = None if found is None else _linear_fields(found)
    if found is None or fields is None:
        reference = regex_linear_columns(raw, file_size)
        return None if reference is None else reference.folded()
    layer, expert, proj, rank, field = fields
    return _summed(layer, expert, proj, rank, field, found.begins, found.ends, found.ndim, found.dims,
                   len(raw), file_size, partial(found.names_joined, len(experts_prefix(layer))))


def regex_linear_columns(raw: bytes, file_size: int) -> ExpertColumns | None:
    """`linear_columns` by one regex split of the header, per (expert, rank): the reference, and the path of any
    header the bulk reading declines."""
    if not raw.isascii():
        return None
    # One pass: the entries' groups, and between them what separates them. The header is in safetensors' own
    # layout, every entry a linear's field, when the pieces between are `{` (and the metadata), commas, `}`.
    parts = _LINEAR_ENTRY.split(raw)
    gaps = parts[::_GROUPS + 1]
    tensors = len(gaps) - 1
    if tensors > MAX_HEADER_TENSORS or split_layout(gaps) is None:
        return None
    entries = len(gaps[0])  # where the entries begin: the metadata before them may hold any string
    found = _EXPERT_LAYER.search(raw, entries)
    if found is None:
        return None
    layer = int(found.group(1))
    if raw.count(b'"model.layers.%d.mlp.experts.' % layer, entries) != tensors:
        return None  # another layer's tensors in the same shard
    if max(map(len, parts[2::_GROUPS + 1] + parts[4::_GROUPS + 1])) > 18:
        return None  # an id past int64 (the full opening names the tensor)
    expert, rank = _ints(parts[2::_GROUPS + 1]), _ints(parts[4::_GROUPS + 1])
    pairs = offset_pairs(parts[7::_GROUPS + 1])
    if pairs is None:
        return None  # the full parser refuses a reversed pair
    begin, end = pairs
    if int(end.max()) >= _EXACT or 8 + len(raw) + int(end.max()) > file_size:
        return None  # a file too short is a byte fault
    proj = _PROJECTION[np.frombuffer(b"".join(parts[3::_GROUPS + 1]), dtype=np.uint8)]
    field_text = np.frombuffer(b"".join(parts[5::_GROUPS + 1]), dtype=np.uint8).reshape(-1, 3).astype(np.int64)
    field = np.searchsorted(_FIELD_CODES, (field_text[:, 0] << 16) | (field_text[:, 1] << 8) | field_text[:, 2])
    sums = _sorted_rank_sums(expert, proj, rank, field, begin, end)
    if sums is None:
        return None  # a name twice in one header: the full parser refuses it by name
    linear, is_trellis, ranks = sums
    shapes = list(compress(parts[6::_GROUPS + 1], is_trellis.tolist()))
    return ExpertColumns(layer, _k_ranges(expert, linear, is_trellis, shapes), ranks, b'"'.join(parts[1::_GROUPS + 1]))


def _sorted_rank_sums(expert: np.ndarray, proj: np.ndarray, rank: np.ndarray, field: np.ndarray, begin: np.ndarray,
                      end: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[tuple[int, int], tuple[int, int]]] | None:
    """(each entry's linear key, which entries are trellis tensors, (bytes, gate trellis tensors) per (expert, rank)),
    by sorting the keys; None where a linear holds a field twice."""
    width = int(rank.max()) + 1
    linear = (expert * 3 + proj) * width + rank
    if not all_distinct(linear * len(_FIELDS) + field):
        return None
    per_rank = expert * width + rank
    keys, slot = np.unique(per_rank, return_inverse=True)
    nbytes = np.bincount(slot, weights=(end - begin).astype(np.float64))
    is_trellis = field == _TRELLIS
    gates = np.bincount(slot, weights=(is_trellis & (proj == 0)).astype(np.float64), minlength=keys.size)
    ranks = {(key // width, key % width): (int(b), int(g)) for key, b, g in zip(keys.tolist(), nbytes, gates)}
    return linear, is_trellis, ranks


def _k_ranges(expert: np.ndarray, linear: np.ndarray, is_trellis: np.ndarray,
              shapes: list[bytes | None]) -> dict[int, tuple[int, int]]:
    """Per expert, the lowest and highest K of its linears, as `MoeLayer.expert_k` reads each one: from a
    three-dimensional trellis shape whose last dimension is a multiple of 16; -1 for any other linear."""
    k_of = {shape: _k(shape) for shape in set(shapes)}
    return _expert_k(expert, linear, is_trellis, np.array([k_of[shape] for shape in shapes], dtype=np.int64))


def _expert_k(expert: np.ndarray, linear: np.ndarray, is_trellis: np.ndarray,
              trellis_k: np.ndarray) -> dict[int, tuple[int, int]]:
    """`_k_ranges` of each trellis tensor's K (`trellis_k`, in the order of the trellis tensors)."""
    trellis_expert = expert[is_trellis]
    lows: dict[int, int] = {}
    highs: dict[int, int] = {}
    if trellis_expert.size:
        order = np.lexsort((trellis_k, trellis_expert))
        sorted_experts, sorted_k = trellis_expert[order], trellis_k[order]
        first = np.unique(sorted_experts, return_index=True)[1]
        last = np.r_[first[1:], sorted_experts.size] - 1
        lows = dict(zip(sorted_experts[first].tolist(), sorted_k[first].tolist()))
        highs = dict(zip(sorted_experts[last].tolist(), sorted_k[last].tolist()))
    linear_experts = expert[np.unique(linear, return_index=True)[1]]
    linears_of = dict(zip(*(a.tolist() for a in np.unique(linear_experts, return_counts=True))))
    with_trellis = dict(zip(*(a.tolist() for a in np.unique(trellis_expert, return_counts=True))))
    out: dict[int, tuple[int, int]] = {}
    for e, count in linears_of.items():
        low = lows.get(e, -1) if with_trellis.get(e, 0) == count else -1  # a linear without its trellis: no K
        out[e] = (low, highs.get(e, -1))
    return out


# A linear field's name after its layer's prefix, read as words from its first byte on: `E.`, then the projection
# (the words at its first byte and at its third, through the dot after it), `rankR.`, then the field with the `"`
# and the start of the entry's fixed text after it (so the word ends the name).
_PROJECTIONS = [(word_of(b"gate_pro"), word_of(b"te_proj.")), (word_of(b"up_proj."), None),
                (word_of(b"down_pro"), word_of(b"wn_proj."))]
_RANK = word_of(b"rank")
_FIELD_WORDS = {word_of((name + b'":{"dtype":"')[:8]): _FIELDS.index((name[:3] + b'"')[:3])
                for name in (b"trellis", b"suh", b"svh", b"su", b"sv", b"mcg", b"mul1")}
_FIELD_KEYS = np.array(sorted(_FIELD_WORDS), dtype=np.uint64)
_FIELD_INDEX = np.array([_FIELD_WORDS[key] for key in sorted(_FIELD_WORDS)], dtype=np.int64)


def _linear_fields(found: Layout) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(layer, expert, projection, rank, field) of every entry of a proven layout, where every name is a
    canonically spelled rank-sliced linear field of one MoE layer (`_LINEAR_ENTRY`'s name, ids of at most
    seven digits); None otherwise (the regex decides)."""
    quotes, words, data, n = found.quotes, found.words, found.data, len(found.quotes)
    match = _EXPERT_LAYER.match(found.raw, int(quotes[0, 0]))
    if match is None or len(match.group(1)) > 18:
        return None
    prefix = b'"' + experts_prefix(int(match.group(1)))
    if not words.holds(quotes[:, 0], prefix):
        return None  # another layer's tensor, or another name
    expert_at = quotes[:, 0] + len(prefix)
    expert_dot = expert_at + digits_at(words, expert_at)
    first, third = words.at(expert_dot + 1), words.at(expert_dot + 3)
    gate, down = (first == _PROJECTIONS[0][0]) & (third == _PROJECTIONS[0][1]), \
        (first == _PROJECTIONS[2][0]) & (third == _PROJECTIONS[2][1])
    up = first == _PROJECTIONS[1][0]
    if not bool((gate | up | down).all()):
        return None
    proj = np.where(up, 1, np.where(down, 2, 0))
    rank_dot = expert_dot + np.where(up, 8, 10)  # (the dot before `rank`)
    rank_word = words.at(rank_dot + 1)  # `rankR.` and on
    if not bool((data[expert_dot] == 46).all()) or not bool(((rank_word & _LOW4) == _RANK).all()):
        return None
    rank = _one_digit(rank_word)  # (a rank of one digit, as every rank of a TP up to 10)
    if rank is not None:
        field_dot = rank_dot + 6
    else:
        rank_at = rank_dot + 5
        field_dot = rank_at + digits_at(words, rank_at)
        rank = short_uints(words, data, rank_at, field_dot)
        if not bool((data[field_dot] == 46).all()):
            return None
    expert = short_uints(words, data, expert_at, expert_dot)
    key = words.at(field_dot + 1)
    at = np.minimum(np.searchsorted(_FIELD_KEYS, key), len(_FIELD_KEYS) - 1)
    if expert is None or rank is None or not bool((_FIELD_KEYS[at] == key).all()):
        return None
    return int(match.group(1)), expert, proj, rank, _FIELD_INDEX[at]


_LOW4 = word_of(b"\xff" * 4)
_DIGIT_DOT = np.uint64(0xFFFF00000000)


def _one_digit(words: np.ndarray) -> np.ndarray | None:
    """Each word's fifth byte as a digit, where every fifth byte is one and every sixth a dot; None otherwise."""
    digit = (words >> np.uint64(32)) & np.uint64(0xFF)
    if not bool(((words & _DIGIT_DOT) - (np.uint64(0x2E30) << np.uint64(32)) < np.uint64(10 << 32)).all()):
        return None
    return (digit - np.uint64(48)).astype(np.int64)


def _summed(layer: int, expert: np.ndarray, proj: np.ndarray, rank: np.ndarray, field: np.ndarray,
            begin: np.ndarray, end: np.ndarray, ndim: np.ndarray, dims: np.ndarray, header_bytes: int,
            file_size: int, names: Callable[[], bytes]) -> LinearColumns | None:
    """`regex_linear_columns`' sums of the same arrays (each trellis tensor's K from its shape's dimensions), folded
    per (K, rank) as `ExpertColumns.folded` folds them."""
    if bool((begin > end).any()):
        return None  # the full parser refuses a reversed pair
    if int(end.max()) >= _EXACT or 8 + header_bytes + int(end.max()) > file_size:
        return None
    width = int(rank.max()) + 1
    experts = int(expert.max()) + 1
    if experts * 3 * width * len(_FIELDS) > 8 * len(expert) + 4096:  # ids far apart: the reference's sorts
        return _sorted_sums(layer, expert, proj, rank, field, begin, end, ndim, dims, names)
    # Small ids (every shard written so): each key a bin of its own, counted in place of sorting.
    linear = (expert * 3 + proj) * width + rank
    if int(np.bincount(linear * len(_FIELDS) + field).max()) > 1:
        return None  # a name twice in one header: the full parser refuses it by name
    per_rank = expert * width + rank
    keys = np.flatnonzero(np.bincount(per_rank))
    nbytes = np.bincount(per_rank, weights=(end - begin).astype(np.float64))[keys]
    is_trellis = field == _TRELLIS
    gates = np.bincount(per_rank, weights=(is_trellis & (proj == 0)).astype(np.float64),
                        minlength=experts * width)[keys]
    trellis_expert = expert[is_trellis]
    last = dims[is_trellis, 2]
    trellis_k = np.where((ndim[is_trellis] == 3) & (last % 16 == 0), last // 16, -1)
    lows = np.full(experts, np.iinfo(np.int64).max)
    highs = np.full(experts, -1)
    np.minimum.at(lows, trellis_expert, trellis_k)
    np.maximum.at(highs, trellis_expert, trellis_k)
    linears_of = (np.bincount(linear, minlength=experts * 3 * width).reshape(experts, 3 * width) > 0).sum(axis=1)
    low = np.where(np.bincount(trellis_expert, minlength=experts) == linears_of, lows, -1)  # (a linear without K)
    k = np.where((low == highs) & (low >= 0), low, -1)  # each expert's one K, -1 for none
    return _folded(layer, k[keys // width], keys % width, nbytes, gates, len(expert), names)


def _folded(layer: int, k: np.ndarray, rank: np.ndarray, nbytes: np.ndarray, gates: np.ndarray, tensors: int,
            names: Callable[[], bytes]) -> LinearColumns:
    """`LinearColumns` of the sums per (expert, rank) (`nbytes`, `gates`: float64 of integers, in the order of the
    pairs; `k`: each pair's expert's K, -1 for none), summed per (K, rank) in the order the pairs first reach each."""
    code = (k + 1) * (int(rank.max()) + 1) + rank
    distinct, first, slot = np.unique(code, return_index=True, return_inverse=True)
    slot = slot.reshape(-1)
    if float(nbytes.sum()) < 2.0 ** 62:  # (far from int64's end: its sums exact)
        tier_bytes = np.zeros(distinct.size, dtype=np.int64)
        np.add.at(tier_bytes, slot, nbytes.astype(np.int64))
        summed = tier_bytes.tolist()
    else:
        summed = [0] * distinct.size
        for at, b in zip(slot.tolist(), nbytes.tolist()):
            summed[at] += int(b)
    counted = np.bincount(slot, weights=gates, minlength=distinct.size).tolist()
    tier_k, tier_rank = k[first].tolist(), rank[first].tolist()
    tiers = {(None if tier_k[at] < 0 else tier_k[at], tier_rank[at]): (summed[at], int(counted[at]))
             for at in np.argsort(first).tolist()}
    return LinearColumns(layer, tiers, tensors, names())


def _sorted_sums(layer: int, expert: np.ndarray, proj: np.ndarray, rank: np.ndarray, field: np.ndarray,
                 begin: np.ndarray, end: np.ndarray, ndim: np.ndarray, dims: np.ndarray,
                 names: Callable[[], bytes]) -> LinearColumns | None:
    """`_summed` by `regex_linear_columns`' own sorts, for ids too far apart to count in bins."""
    sums = _sorted_rank_sums(expert, proj, rank, field, begin, end)
    if sums is None:
        return None
    linear, is_trellis, ranks = sums
    last = dims[is_trellis, 2]
    trellis_k = np.where((ndim[is_trellis] == 3) & (last % 16 == 0), last // 16, -1)
    return LinearColumns(layer, _fold(_expert_k(expert, linear, is_trellis, trellis_k), ranks), len(expert), names())


def all_distinct(values: np.ndarray) -> bool:
    """No value twice (sorted: numpy's hashed `unique` is many times slower on a million integers)."""
    ordered = np.sort(values)
    return not bool((ordered[1:] == ordered[:-1]).any())


def _k(shape: bytes | None) -> int:
    dims = shape.split(b",") if shape else []
    if len(dims) != 3 or int(dims[2]) % 16:
        return -1
    return int(dims[2]) // 16


def _ints(texts: list[bytes]) -> np.ndarray:
    return np.fromstring(b" ".join(texts), dtype=np.int64, sep=" ")


__all__ = ["ExpertColumns", "LinearColumns", "all_distinct", "linear_columns", "no_expert_tensors"]
