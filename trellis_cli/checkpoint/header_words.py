"""A raw header proven to be in safetensors' own layout in bulk: every `"` found by one numpy scan, the fixed text
between them compared as 8-byte words read at those positions, every number parsed eight digits at a time. It
proves what `header.canonical_entries` matches with one regex over the whole header (and what `columns.py`'s split
reads), a few times faster on a production shard (12,288 entries): numpy passes over the bytes, no object per
entry. It declines (None) whatever it cannot prove so; the caller then takes the regex path, which decides.

In that layout each entry is `"NAME":{"dtype":"DTYPE","shape":[DIMS],"data_offsets":[BEGIN,END]}`: ten quotes,
the name between the first two (never a `"`: every quote of the header is one of these ten or the head's).
"""

from __future__ import annotations

import re
import threading
from typing import NamedTuple

import numpy as np

from trellis_cli.header import DIM_PATTERN, DTYPE_BYTES, MAX_HEADER_TENSORS, split_layout

_U8 = np.uint64(8)
_TAIL = 32  # (how far from its end a header is searched for its trailing spaces first)
_OFFSET_DIGITS = 18  # header.OFFSET_PATTERN


def word_of(text: bytes) -> np.uint64:
    """Up to 8 bytes as the little-endian word `Words` reads where they are written (the rest zero)."""
    return np.uint64(int.from_bytes(text.ljust(8, b"\0")[:8], "little"))


class Words:
    """A header's bytes as an 8-byte word at every position: `at(p)` is the word of bytes p..p+7, for a fixed text
    compared in one gather per 8 bytes. A word that would run past the last byte is the last 8 bytes instead
    (only a malformed last entry reads there: its fixed text never matches a header's `]}}` and spaces, and a
    digit count read there is proven by the comma it finds and the numbers' own words); a position before the
    first byte wraps around, as numpy indexes (the numbers read there mask those bytes off)."""

    def __init__(self, raw: bytes) -> None:
        self._view = np.ndarray((len(raw) - 7,), dtype="<u8", buffer=raw, strides=(1,))
        self._last = len(raw) - 8

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self._view[np.minimum(positions, self._last)]

    def holds(self, positions: np.ndarray, text: bytes) -> bool:
        """Whether `text` is written at every position (compared 8 bytes at a time, the last 8 overlapping)."""
        starts = list(range(0, len(text) - 7, 8))
        if len(text) % 8:
            starts.append(max(0, len(text) - 8))
        for start in starts:
            piece = text[start:start + 8]
            found = self.at(positions + start)
            if len(piece) < 8:
                found = found & word_of(b"\xff" * len(piece))
            if not bool((found == word_of(piece)).all()):
                return False
        return True


# Per digit count k (0..8): the mask of a word's last k bytes, and '0' in the bytes before them.
_KEEP = np.array([((1 << 64) - 1) ^ ((1 << (8 * (8 - k))) - 1) if k else 0 for k in range(9)], dtype=np.uint64)
_ZEROS = np.array([0x3030303030303030 & ~int(keep) for keep in _KEEP], dtype=np.uint64)
_HIGH = np.uint64(0xF0F0F0F0F0F0F0F0)
_THREES = np.uint64(0x3030303030303030)
_SIX = np.uint64(0x0606060606060606)


def _eight_digits(words: np.ndarray) -> np.ndarray:
    """Eight ASCII digits per word, the first the most significant, as their value (three multiplies)."""
    v = ((words & np.uint64(0x0F0F0F0F0F0F0F0F)) * np.uint64(2561)) >> _U8
    v = ((v & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(6553601)) >> np.uint64(16)
    return ((v & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)


def uints(words: Words, raw_bytes: np.ndarray, starts: np.ndarray, ends: np.ndarray, most: int,
          rows: np.ndarray | None = None) -> np.ndarray | None:
    """The numbers written at [start, end) (`0|[1-9][0-9]*`, at most `most` <= 18 digits each) as int64, 0 where
    `rows` (a mask) leaves a row out; None where any is not one."""
    width = ends - starts
    if rows is not None:
        width = np.where(rows, width, 1)
    if not width.size:
        return np.zeros(0, dtype=np.int64)
    if int(width.min()) < 1 or int(width.max()) > most:
        return None
    if bool(((raw_bytes[np.where(width > 1, starts, 0)] == 48) & (width > 1)).any()):
        return None  # a leading zero
    total = np.zeros(width.size, dtype=np.uint64)
    for chunk in range((int(width.max()) + 7) // 8):  # eight digits at a time, from the last
        k = np.clip(width - 8 * chunk, 0, 8)
        text = (words.at(ends - 8 * chunk - 8) & _KEEP[k]) | _ZEROS[k]
        if rows is not None:
            text = np.where(rows, text, _THREES)
        if not bool((((text & _HIGH) == _THREES) & (((text + _SIX) & _HIGH) == _THREES)).all()):
            return None
        total += _eight_digits(text) * np.uint64(10 ** (8 * chunk))
    return total.astype(np.int64)


_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_TOP = np.uint64(0x8080808080808080)
_PAST_NINE = np.uint64(0x7676767676767676)  # (0x80 - 10 per byte: a byte past 9 reaches its top bit)


def digits_at(words: Words, starts: np.ndarray) -> np.ndarray:
    """How many ASCII digits are written from each start on, where fewer than 8 (a byte that is not a digit among
    the first eight); 8 where all eight are."""
    text = words.at(starts) ^ _THREES  # (a digit's byte becomes 0-9)
    other = (((text & _LOW7) + _PAST_NINE) | text) & _TOP
    lowest = other & (~other + np.uint64(1))  # (the first byte that is not a digit: its top bit alone)
    found = np.log2(np.where(other > 0, lowest, np.uint64(1) << np.uint64(63)).astype(np.float64))
    return np.where(other > 0, found.astype(np.int64) // 8, 8)


def short_uints(words: Words, data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """`uints` of runs `digits_at` found (1 to 7 digits each, every byte a digit): the value of each, None where
    one is empty or has a leading zero."""
    width = ends - starts
    if not bool(((width >= 1) & (width <= 8) & ((data[starts] != 48) | (width == 1))).all()):
        return None
    return _eight_digits((words.at(ends - 8) & _KEEP[width]) | _ZEROS[width]).astype(np.int64)


def _digit_run(words: Words, starts: np.ndarray, most: int) -> np.ndarray:
    """How many digits are written from each start on, counted up to `most` (rounded up to a word). A word is read
    past the first only where the run fills it (so never past the header's last byte)."""
    run = digits_at(words, starts)
    whole = np.flatnonzero(run == 8)  # (the run goes on past this word)
    for more in range(8, most, 8):
        if not whole.size:
            break
        next_run = digits_at(words, starts[whole] + more)
        run[whole] += next_run
        whole = whole[next_run == 8]
    return run


_DTYPES = sorted((int(word_of(name.encode())), len(name)) for name in DTYPE_BYTES)
_DTYPE_WORDS = np.array([w for w, _ in _DTYPES], dtype=np.uint64)
_DTYPE_WIDTHS = np.array([n for _, n in _DTYPES], dtype=np.int64)


class Layout(NamedTuple):
    """A header proven in safetensors' own layout, as positions: per entry its ten quotes, its dtype (a word), its
    shape (dimension count and the three dimensions, 0 where absent) and its offsets; the head's metadata."""

    raw: bytes
    words: Words
    data: np.ndarray  # the raw header, uint8
    head: int  # where the first entry's `"` is
    metadata: dict[str, str]
    quotes: np.ndarray  # (entries, 10)
    dtype: np.ndarray  # each entry's dtype as a word (`word_of`)
    ndim: np.ndarray
    dims: np.ndarray  # (entries, 3)
    begins: np.ndarray
    ends: np.ndarray

    def names_joined(self) -> bytes:
        """Every name in stored order, joined by `"`: the header's bytes kept where they are a name or its closing
        quote (runs of kept and dropped bytes alternate), the last quote dropped."""
        starts, stops = self.quotes[:, 0] + 1, self.quotes[:, 1] + 1
        stops[-1] -= 1  # (the last name without its quote)
        runs = np.empty(2 * len(starts) + 1, dtype=np.int64)
        runs[0::2] = np.r_[starts, len(self.raw)] - np.r_[0, stops]  # dropped: from a name's quote to the next name
        runs[1::2] = stops - starts
        kinds = np.zeros(runs.size, dtype=bool)
        kinds[1::2] = True
        kept = np.repeat(kinds, runs)
        return self.data[kept].tobytes()


_SCRATCH = threading.local()


def _scratch(size: int) -> np.ndarray:
    """A bool buffer of `size` this thread reuses for every header it reads: a fresh one of a header's size is
    mapped anew each time, a page fault per 4 KB (~350 per production shard)."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _SCRATCH.buffer = np.empty(size, dtype=bool)
    return buffer[:size]


def layout(raw: bytes) -> Layout | None:
    """`raw` as a `Layout` where it is ASCII and in safetensors' own layout, as `header.canonical_entries` accepts
    it; None where that cannot be proven here (no promise that the regex refuses it)."""
    first = raw.find(b'":{"dtype":"')
    start = raw.rfind(b'"', 0, first) if first > 0 else -1
    if start < 1 or len(raw) < 64 or not raw.isascii() or b"\\" in raw:
        return None
    data = np.frombuffer(raw, dtype=np.uint8)
    if int(data.min()) < 32:
        return None  # (no escape, no control character: every name is its bytes)
    last = len(raw) - (len(raw[-_TAIL:]) - len(raw[-_TAIL:].rstrip(b" ")))
    if last <= len(raw) - _TAIL:
        last = len(raw.rstrip(b" "))
    metadata = split_layout([raw[:start], raw[last - 1:]])  # the head and the closing brace; the rest is proven below
    if metadata is None:
        return None
    found = np.flatnonzero(np.equal(data, 34, out=_scratch(len(raw))))
    quotes = found[np.searchsorted(found, start):]
    if not quotes.size or quotes.size % 10 or quotes.size // 10 >= MAX_HEADER_TENSORS:
        return None
    quotes = quotes.reshape(-1, 10)
    if int(quotes[-1, 9]) + 11 > len(raw):
        return None  # (no word is read past the last byte: the last offsets' first eight bytes are read)
    named = quotes[quotes[:, 1] - quotes[:, 0] == 13, 0]
    if any(raw[at:at + 14] == b'"__metadata__"' for at in named.tolist()):
        return None  # (a name `__metadata__` is no tensor)
    words = Words(raw)
    # The fixed text around the three variable parts; each fixes where its quotes are (no other quote between).
    ends = np.empty(len(quotes), dtype=np.int64)  # each entry's `]` after its offsets
    ends[:-1] = quotes[1:, 0] - 3
    ends[-1] = last - 3
    if not (words.holds(quotes[:, 1], b'":{"dtype":"') and words.holds(quotes[:, 5], b'","shape":[')
            and words.holds(quotes[:, 8] - 2, b'],"data_offsets":[')
            and bool(((words.at(ends[:-1]) & word_of(b"\xff" * 3)) == word_of(b"]},")).all())
            and raw[last - 3:last] == b"]}}"):
        return None
    # The dtype: one of the known names.
    width = quotes[:, 5] - quotes[:, 4] - 1
    dtype = words.at(quotes[:, 4] + 1) & _KEEP_LOW[np.clip(width, 0, 8)]
    known = np.minimum(np.searchsorted(_DTYPE_WORDS, dtype), len(_DTYPE_WORDS) - 1)
    if not bool(((_DTYPE_WORDS[known] == dtype) & (_DTYPE_WIDTHS[known] == width)).all()):
        return None
    # The shape's dimensions, and the offsets (digits, a comma, digits).
    shape = _dims(words, raw, quotes[:, 7] + 3, quotes[:, 8] - 2)
    if shape is None:
        return None
    offset_begin = quotes[:, 9] + 3
    comma = np.minimum(offset_begin + _digit_run(words, offset_begin, _OFFSET_DIGITS + 1), len(raw) - 1)
    if not bool((data[comma] == 44).all()):
        return None
    begins = uints(words, data, offset_begin, comma, _OFFSET_DIGITS)
    stops = uints(words, data, comma + 1, ends, _OFFSET_DIGITS)
    if begins is None or stops is None:
        return None
    return Layout(raw, words, data, start, metadata, quotes, dtype, *shape, begins, stops)


# Per byte count k (0..8): the mask of a word's first k bytes.
_KEEP_LOW = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


_FEW = 32  # distinct shapes found one at a time; more are sorted


def _groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each distinct key's first row, and each row's group (an index into those), as `np.unique` returns them
    (in the order of first rows rather than of keys): a shard has a few shapes, each found in one pass."""
    group = np.full(keys.size, -1, dtype=np.int64)
    first: list[int] = []
    at = 0
    while len(first) < _FEW:
        group[keys == keys[at]] = len(first)
        first.append(at)
        left = group < 0
        at = int(left.argmax())
        if not left[at]:
            return np.array(first, dtype=np.int64), group
    _, rows, group = np.unique(keys, return_index=True, return_inverse=True)
    return rows, group


_SHAPE = re.compile(rb"(?:" + DIM_PATTERN + rb"(?:," + DIM_PATTERN + rb"){0,2})?")
_MIX = [np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)]


def _dims(words: Words, raw: bytes, begin: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Each shape's dimension count and dimensions (`[]` or up to three numbers of up to five digits): a shard
    has a few distinct shapes, so each distinct text (at most 17 bytes: three words) is read once. The entries are
    grouped by a mix of their words, then every entry's words compared with its group's first (a mix two texts
    share cannot join them)."""
    width = end - begin
    if int(width.max()) > 17:
        return None
    parts = [words.at(end - 8 * i - 8) & _KEEP[np.clip(width - 8 * i, 0, 8)] for i in range(3)]
    mixed = width.astype(np.uint64) * _MIX[2]
    for part, mix in zip(parts, _MIX):
        mixed ^= part * mix
    first, group = _groups(mixed)
    if not all(bool((part == part[first][group]).all()) for part in [width] + parts):
        return None
    shapes = []
    for at in first.tolist():
        text = raw[int(begin[at]):int(end[at])]
        if _SHAPE.fullmatch(text) is None:
            return None
        dims = [int(d) for d in text.split(b",")] if text else []
        shapes.append([len(dims)] + dims + [0] * (3 - len(dims)))
    table = np.array(shapes, dtype=np.int64)[group]
    return table[:, 0], table[:, 1:]


__all__ = ["Layout", "Words", "digits_at", "layout", "short_uints", "uints", "word_of"]
