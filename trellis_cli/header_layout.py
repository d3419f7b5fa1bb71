"""The bulk reader of safetensors' own header layout: a raw header proven to be in the layout safetensors writes
(`{"__metadata__":{..},"NAME":{"dtype":"..","shape":[..],"data_offsets":[..]},..}`: no whitespace but the trailing
pad, no escape, flat string metadata, at most three short dimensions) and its columns (names, kinds, offsets) read in
bulk with numpy, without decoding its JSON: decoding builds an object per value, and a production layer shard lists
12,288 tensors. The columns become the same records the strict parser builds (`header_of_columns`).

Whatever cannot be proven so is declined (None) to the strict parser (`header.py`: `parse_header` asks here first),
which decides it and words every refusal. No file is opened here: the bytes come from the parser or the reader
(`checkpoint/reader.py`, whose workers read the columns).
"""

from __future__ import annotations

import json
import re
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import repeat
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trellis_cli.header_records import (DTYPE_NAMES, DTYPE_BYTES, MAX_HEADER_TENSORS, Entries, Header, TensorEntry,
                                        nbytes_of)

# safetensors' own header layout: `{"__metadata__":{...},"name":{"dtype":"..","shape":[..],"data_offsets":[a,b]},
# ...}`, no whitespace but the trailing pad, no escape (so every `"` delimits a string and no name needs decoding),
# the metadata a flat map of strings, at most three dimensions of at most five digits (no shape overflows a
# 64-bit size), offsets below 10^18. In that layout a name followed by `":{"dtype"` is a tensor's key, never a
# metadata value. One match of the whole header proves it (a fifth of the time of decoding it).
DTYPE_PATTERN = b"(?:" + b"|".join(d.encode() for d in DTYPE_BYTES) + b")"
DIM_PATTERN = rb"(?:0|[1-9][0-9]{0,4})"
OFFSET_PATTERN = rb"(?:0|[1-9][0-9]{0,17})"
_STRING = rb'"[^"\\\x00-\x1f]*"'
# An entry's three parts: its name, its kind (`DTYPE","shape":[DIMS`) and its offsets (`BEGIN,END`).
_NAME = rb'(?!__metadata__")[^"\\\x00-\x1f]*'
_KIND = DTYPE_PATTERN + rb'","shape":\[(?:' + DIM_PATTERN + rb"(?:," + DIM_PATTERN + rb"){0,2})?"
_PAIR = OFFSET_PATTERN + b"," + OFFSET_PATTERN
_ENTRY = rb'"' + _NAME + rb'":\{"dtype":"' + _KIND + rb'\],"data_offsets":\[' + _PAIR + rb"\]\}"
_METADATA = rb'"__metadata__":\{(?:' + _STRING + b":" + _STRING + rb"(?:," + _STRING + b":" + _STRING + rb")*)?\}"
_CANONICAL = re.compile(rb"\{(?P<metadata>" + _METADATA + rb",)?" + _ENTRY + rb"(?:," + _ENTRY + rb")*\} *")


def canonical_entries(raw: bytes) -> bytes | None:
    """The entries of `raw` (the header after its `__metadata__`) when it is a header in safetensors' own layout
    that the strict parser accepts as it is (valid UTF-8, within the tensor limit); None otherwise. Two facts only
    decoding shows: a name twice in one object, and an offset pair whose begin is past its end (`parse_header`
    checks both on its fast path). In the entries of that layout a `"` followed by a name starts a tensor's key."""
    match = _canonical_match(raw)
    if match is None:
        return None
    return raw[match.end("metadata"):] if match.group("metadata") is not None else raw


_HEAD = re.compile(rb"\{(?:(" + _METADATA + rb"),)?")


def split_layout(gaps: list[bytes]) -> dict[str, str] | None:
    """The metadata of a header split by a pattern of its entries (`re.split`; `gaps` the pieces between the
    entries), where those pieces prove safetensors' own layout: before the first entry the canonical head (`{`,
    then the `__metadata__` object and a comma, if any, no metadata key twice), a comma between two entries, the
    closing brace and its pad after the last; at least one entry. None otherwise."""
    entries = len(gaps) - 1
    if not entries or gaps[1:-1].count(b",") != entries - 1 or _TRAILER.fullmatch(gaps[-1]) is None:
        return None
    return _canonical_metadata(gaps[0])


def offset_pairs(texts: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
    """(begins, ends) of entries' `data_offsets` written `BEGIN,END` (each matched by OFFSET_PATTERN: below
    10^18, exact in int64); None where a pair is reversed, which the strict parser names."""
    return offset_pairs_of(b",".join(texts), len(texts))


def offset_pairs_of(text: bytes, count: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`offset_pairs` of `count` pairs written `BEGIN,END,BEGIN,END...`."""
    offsets = np.fromstring(text, dtype=np.int64, sep=",")
    begins, ends = offsets[0::2], offsets[1::2]
    if len(offsets) != 2 * count or bool((begins > ends).any()):
        return None
    return begins, ends


def _canonical_metadata(head: bytes) -> dict[str, str] | None:
    """The metadata of the head of a header in safetensors' own layout (`{`, then the `__metadata__` object and a
    comma, if any, no metadata key twice), empty where it has none; None for any other head."""
    match = _HEAD.fullmatch(head)
    if match is None:
        return None
    meta_text = match.group(1)
    if meta_text is None:
        return {}
    metadata: dict[str, str] = json.loads(b"{" + meta_text + b"}")["__metadata__"]
    return metadata if len(metadata) == meta_text.count(b'":"') else None


def canonical_header(raw: bytes) -> bool:
    return _canonical_match(raw) is not None


def _canonical_match(raw: bytes) -> re.Match[bytes] | None:
    if not (raw.isascii() or _utf8(raw)) or raw.count(b'"data_offsets"') > MAX_HEADER_TENSORS:
        return None
    return _CANONICAL.fullmatch(raw)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class HeaderColumns(NamedTuple):
    """A canonical header's entries as a handful of columns (`canonical_columns`): small to send from a worker
    process, which reads and splits the bytes, to the one that builds the records (`header_of_columns`)."""

    length: int  # the header's bytes (N)
    names: str  # every name in stored order, joined by `"` (no name holds one)
    kinds: list[bytes]  # the distinct kinds (`DTYPE","shape":[DIMS`), in order of first use
    kind_index: np.ndarray  # each entry's kind: a position in `kinds`
    begins: np.ndarray  # int64 `data_offsets`, each begin <= its end
    ends: np.ndarray
    metadata: dict[str, str]


def canonical_columns(header_bytes: bytes) -> HeaderColumns | None:
    """The columns of a header in safetensors' own layout, read without decoding its JSON: one split of the bytes by
    the entry's pattern (`_ENTRY_PARTS`) both proves the layout (what lies between the entries is a comma, before
    them the canonical head, after them the closing brace) and yields each entry's name, kind (dtype and shape) and
    offsets. None where it is not that layout, a name appears twice or an offset pair is reversed, which the strict
    path then names. A pure function of the bytes: a worker process may compute it. The common header (ASCII, every
    entry in that layout) is read in bulk (`_layout_columns`, from the header's proven `layout`); the split by the
    pattern is the reference it must equal, and decides whatever the bulk read cannot prove."""
    bulk = _layout_columns(header_bytes)
    return bulk if bulk is not None else _split_columns(header_bytes)


def _layout_columns(header_bytes: bytes) -> HeaderColumns | None:
    """`canonical_columns` of a header `layout` proves in safetensors' own layout (ASCII, no escape): the reference
    (`_split_columns`) splits such a header into exactly its entries (no match of the entry's pattern can start in
    the canonical head), so the columns are equal. Checked here besides the layout: no name twice, no reversed
    pair. None wherever that is not proven: the reference decides."""
    found = layout(header_bytes)
    if found is None or bool((found.begins > found.ends).any()):
        return None
    quotes = found.quotes
    names = found.names_joined().decode("ascii")
    if not _distinct_names(found.data, quotes[:, 0] + 1, quotes[:, 1], names):
        return None
    # Each entry's kind (`DTYPE","shape":[DIMS`, one text per dtype and dims: no leading zero) as one exact key:
    # the dtype's place among the known ones in 4 bits, the dimension count in 2, each dimension (< 10^5) in 17.
    key = found.kind | (found.ndim << 4)
    for at in range(3):
        key |= found.dims[:, at] << (6 + 17 * at)
    first, group = _groups(key)
    kinds = [header_bytes[int(quotes[at, 4]) + 1:int(quotes[at, 8]) - 2] for at in first.tolist()]
    return HeaderColumns(len(header_bytes), names, kinds, group.astype(np.int32), found.begins, found.ends,
                         found.metadata)


def _split_columns(header_bytes: bytes) -> HeaderColumns | None:
    """`canonical_columns` by one split of the bytes by the entry's pattern, a match per entry."""
    if not (header_bytes.isascii() or _utf8(header_bytes)) or \
            header_bytes.count(b'"data_offsets"') > MAX_HEADER_TENSORS:
        return None
    parts = _ENTRY_PARTS.split(header_bytes)
    metadata = split_layout(parts[::4])
    pairs = None if metadata is None else offset_pairs(parts[3::4])
    if metadata is None or pairs is None:
        return None
    if len(set(parts[1::4])) != len(parts) // 4:
        return None  # a key twice in one object (two names of equal bytes: equal texts, UTF-8 being one-to-one)
    names = b'"'.join(parts[1::4]).decode()  # no name holds a `"`: one decode for all of them
    kinds = parts[2::4]
    position = {text: at for at, text in enumerate(dict.fromkeys(kinds))}  # a shard has a few (dtype, shape) kinds
    kind_index = np.fromiter(map(position.__getitem__, kinds), dtype=np.int32, count=len(kinds))
    return HeaderColumns(len(header_bytes), names, list(position), kind_index, *pairs, metadata)


def _distinct_names(data: np.ndarray, begins: np.ndarray, ends: np.ndarray, names: str) -> bool:
    """Whether no name stands twice: proven by keys of their bytes where the keys all differ (names of at most 128
    bytes), else by a set of the names."""
    lengths = ends - begins
    width = -(-int(lengths.max()) // 8) * 8
    if width <= 128:
        _, key = _span_words(data, begins, lengths, width)
        ordered = np.sort(key)
        if not bool((ordered[1:] == ordered[:-1]).any()):
            return True
    return len(set(names.split('"'))) == len(begins)


def all_at(data: np.ndarray, at: np.ndarray, text: bytes) -> bool:
    """Whether `text` stands in `data` (bytes as uint8) at each of the positions `at` (compared 8 bytes at a time);
    False where one would run past either end."""
    if not len(at):
        return True
    last = int(at.max())
    if int(at.min()) < 0 or last + len(text) > len(data):
        return False
    words = _words(data, last + len(text) + 7)  # (the last word read starts before the text's end)
    for k in range(0, len(text), 8):
        chunk = text[k:k + 8]
        found = words[at + k] if len(chunk) == 8 else words[at + k] & _LOW_BYTES[len(chunk)]
        if not bool((found == word_of(chunk)).all()):
            return False
    return True


def _words(data: np.ndarray, needed: int) -> np.ndarray:
    """The 8 bytes from each position of `data` as a little-endian word (unaligned reads, no copy), zeros past its
    end; `needed`: the bytes the words read must cover (the data is copied with a pad only where they run past)."""
    if needed > len(data):
        data = np.concatenate((data, np.zeros(needed - len(data), dtype=np.uint8)))
    return np.ndarray((len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))


def distinct_spans(data: np.ndarray, begins: np.ndarray, ends: np.ndarray,
                   width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The spans `data[begins[i]:ends[i]]` (bytes with no zero among them) told apart in bulk: the first span of each
    distinct text, in order of first use, and each span's position among those; None where a span is longer than
    `width` (a multiple of 8). Each span is read as words of 8 bytes, the bytes past its end zeroed, folded into one
    key; each span is then compared with the first one of its key, so that two texts under one key are never taken
    as one (None then too)."""
    lengths = ends - begins
    if not len(begins) or int(lengths.min()) < 0 or int(lengths.max()) > width:
        return None
    words, key = _span_words(data, begins, lengths, width)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    if words.shape[1] > 1 and not bool((words == words[first[inverse]]).all()):
        return None
    order = np.argsort(first, kind="stable")
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    return first[order], position[inverse]


def _span_words(data: np.ndarray, begins: np.ndarray, lengths: np.ndarray,
                width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each span as `width // 8` words, the bytes past its end zeroed (a row per span), and the words folded into
    one key per span (wrapping: equal spans have equal keys, not the converse)."""
    if int(begins.max()) + width > len(data):
        data = np.concatenate((data, np.zeros(width, dtype=np.uint8)))
    words = sliding_window_view(data, width)[begins].view("<u8")  # (a copy: a row of bytes per span)
    words &= _LOW_BYTES[np.clip(lengths[:, None] - np.arange(0, width, 8), 0, 8)]
    key = words[:, 0].copy()
    for k in range(1, width // 8):
        key = key * np.uint64(1_000_003) + words[:, k]
    return words, key


# The low k bytes of a word (k = 0..8), as a mask.
_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


# A raw header proven in safetensors' own layout in bulk (`layout`): every `"` found by one numpy scan, the fixed
# text between them compared as 8-byte words read at those positions, every number parsed eight digits at a time. It
# proves what `canonical_entries` matches with one regex over the whole header, a few times faster on a production
# shard (12,288 entries): numpy passes over the bytes, no object per entry. It declines (None) whatever it cannot
# prove so; the caller then takes the regex path, which decides. `canonical_columns` reads its columns from it, and
# so do fit's linear columns and the dry run's counts (`checkpoint/columns.py`, `checkpoint/reader.py`).
# In that layout each entry is `"NAME":{"dtype":"DTYPE","shape":[DIMS],"data_offsets":[BEGIN,END]}`: ten quotes,
# the name between the first two (never a `"`: every quote of the header is one of these ten or the head's).
_U8 = np.uint64(8)
_TAIL = 32  # (how far from its end a header is searched for its trailing spaces first)
_OFFSET_DIGITS = 18  # OFFSET_PATTERN


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
        self._data = np.frombuffer(raw, dtype=np.uint8)
        self._view = np.ndarray((len(raw) - 7,), dtype="<u8", buffer=raw, strides=(1,))
        self._last = len(raw) - 8

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self._view[np.minimum(positions, self._last)]

    def holds(self, positions: np.ndarray, text: bytes) -> bool:
        """Whether `text` is written at every position (`all_at`: none running past the end)."""
        return all_at(self._data, positions, text)


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
    kind: np.ndarray  # and as its place among the known dtypes (0..15)
    ndim: np.ndarray
    dims: np.ndarray  # (entries, 3)
    begins: np.ndarray
    ends: np.ndarray

    def names_joined(self, skip: int = 0) -> bytes:
        """Every name in stored order from its byte `skip` on (a prefix every name has, left out), joined by `"`:
        the header's bytes kept where they are such a part of a name or its closing quote (runs of kept and dropped
        bytes alternate), the last quote dropped."""
        starts, stops = self.quotes[:, 0] + 1 + skip, self.quotes[:, 1] + 1
        stops[-1] -= 1  # (the last name without its quote)
        runs = np.empty(2 * len(starts) + 1, dtype=np.int64)
        runs[0::2] = np.r_[starts, len(self.raw)] - np.r_[0, stops]  # dropped: from a name's quote to the next part
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
    """`raw` as a `Layout` where it is ASCII and in safetensors' own layout, as `canonical_entries` accepts
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
    dtype = words.at(quotes[:, 4] + 1) & _LOW_BYTES[np.clip(width, 0, 8)]
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
    return Layout(raw, words, data, start, metadata, quotes, dtype, known, *shape, begins, stops)


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
    order = np.argsort(rows)  # (np.unique orders by key: put the groups back in the order of their first rows)
    place = np.empty_like(order)
    place[order] = np.arange(order.size)
    return rows[order], place[group.reshape(-1)]


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


def header_of_columns(file: str, columns: HeaderColumns, file_size: int | None) -> Header:
    """The header whose columns are `columns` (`canonical_columns`), its records built in C."""
    kind_of = [_entry_kind(text) for text in columns.kinds]
    dtypes = [dtype for dtype, _ in kind_of]
    shapes = [shape for _, shape in kind_of]
    index = columns.kind_index.tolist()
    entries = list(map(tuple.__new__, repeat(TensorEntry),
                       zip(columns.names.split('"'), repeat(file), map(dtypes.__getitem__, index),
                           map(shapes.__getitem__, index), *_offset_objects(columns.begins, columns.ends),
                           repeat(8 + columns.length))))
    return Header(file=file, header_len=columns.length, file_size=file_size,
                  tensors=Entries(entries, _tiled_end(columns, kind_of)), metadata=columns.metadata)


def _tiled_end(columns: HeaderColumns, kind_of: list[tuple[str, tuple[int, ...]]]) -> int | None:
    """The last end where the entries tile the data buffer from 0 in stored order, each of its dtype x shape:
    proven on the columns in numpy (what `safetensors_layout` would otherwise prove per tensor); else None."""
    begins, ends = columns.begins, columns.ends
    sizes = [nbytes_of(dtype, shape) for dtype, shape in kind_of]
    if not len(begins) or max(sizes) >= 1 << 62:  # (a shape within DIM_PATTERN stays far below)
        return None
    if begins[0] != 0 or not bool((begins[1:] == ends[:-1]).all()):
        return None
    expected = np.asarray(sizes, dtype=np.int64)[columns.kind_index]
    return int(ends[-1]) if bool((ends - begins == expected).all()) else None


def parse_canonical(file: str, header_bytes: bytes, header_len: int, file_size: int | None) -> Header | None:
    """The header of a canonical layout (`canonical_columns`, then `header_of_columns`); None where the strict
    path decides. (`header_len` is the length of `header_bytes`, which `parse_header` checked.)"""
    columns = canonical_columns(header_bytes)
    return None if columns is None else header_of_columns(file, columns, file_size)


def _offset_objects(begins: np.ndarray, ends: np.ndarray) -> tuple[list[int], list[int]]:
    """The offsets as Python ints. Where the entries are stored back to back (safetensors' own writers), each
    begins where the one before it ends: one int object for both (two per tensor cost ~50 MB at production size)."""
    end_list = _shared_ends(ends)
    if bool((begins[1:] == ends[:-1]).all()):
        return begins[:1].tolist() + end_list[:-1], end_list
    return begins.tolist(), end_list


# Within `shared_offsets()`: [the ends of the last header read, their int objects].
_LAST_ENDS: ContextVar[list | None] = ContextVar("last_ends", default=None)


@contextmanager
def shared_offsets() -> Iterator[None]:
    """Within this block each header read takes the int objects of the header read before it for the leading run of
    its offsets that the two share: shards laid out alike (the same tensors of the same sizes in the same order, as
    the layer shards of a checkpoint whose layers share one layout) then hold one object per offset between them,
    not one per tensor each (23 MB of validate's peak over the 76 layer shards of a production-shape synthetic
    checkpoint). Shards laid out otherwise share what they share from their first tensor on, or nothing."""
    token = _LAST_ENDS.set([])
    try:
        yield
    finally:
        _LAST_ENDS.reset(token)


def _shared_ends(ends: np.ndarray) -> list[int]:
    """`ends` as Python ints: within `shared_offsets()`, those equal to the last header's ends from the first on
    are its objects (the values are the same; only fewer objects hold them)."""
    last = _LAST_ENDS.get()
    if not last:  # outside the block, or its first header
        out = ends.tolist()
    else:
        before, objects = last
        n = min(len(before), len(ends))
        differ = np.flatnonzero(before[:n] != ends[:n])
        same = int(differ[0]) if differ.size else n
        out = objects[:same] + ends[same:].tolist()
    if last is not None:
        last[:] = [ends, out]
    return out


# One entry of the canonical layout (`_ENTRY`) with its three parts as groups: the fewest objects per tensor (a
# production header has 12k entries).
_ENTRY_PARTS = re.compile(rb'"(' + _NAME + rb')":\{"dtype":"(' + _KIND + rb')\],"data_offsets":\[(' + _PAIR + rb")\]\}")
_TRAILER = re.compile(rb"\} *")


def _entry_kind(text: bytes) -> tuple[str, tuple[int, ...]]:
    dtype, dims = text.split(b'","shape":[')
    return DTYPE_NAMES[dtype.decode()], tuple(map(int, dims.split(b","))) if dims else ()
