"""A header read in bulk (`header_layout.layout`) against the regexes it stands in for: fit's linear columns (the
names' parts as words, summed per (K, rank)) against `regex_linear_columns` (summed per (expert, rank), then
folded), and the dry run's counts (`reader.counted_in_bulk`) against `canonical_entries` and its counts; field for
field the same answer, None where it is None, on the synth's shards and on many seeded changes to their raw
headers (names swapped or twice, escapes, non-ASCII, reversed or huge offsets, other spellings, another layer, odd
quotes and dots)."""

from __future__ import annotations

import random
import re
import struct

import numpy as np
import pytest

from corrupt import READER_CORPUS
from helpers import tiny_checkpoint
from trellis_cli.checkpoint import columns
from trellis_cli.checkpoint.columns import linear_columns, regex_linear_columns
from trellis_cli.checkpoint.reader import CodeCounts, _expert_layers, counted_in_bulk
from trellis_cli.header_layout import canonical_entries, layout

VARIANTS = [{}, {"non_expert": "bf16"}, {"codebook": "3inst"}, {"uniform_k": 4, "partition": None},
            {"mtp_layers": 1, "non_expert": "bf16"}, {"tp": 1},
            {"experts": 120, "partition": (100, 20), "tp": 4, "intermediate": 512, "layers": (9, 10)},  # (ids of one to three digits)
            {"tp": 12, "intermediate": 1536, "experts": 4, "partition": (3, 1), "layers": (3, 4)}]  # (ranks of two digits)


def raw_headers(root):
    out = []
    for shard in sorted(root.glob("*.safetensors")):
        data = shard.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        out.append((data[8:8 + n], len(data)))
    return out


def counted_by_regex(raw):
    entries = canonical_entries(raw)
    if entries is None:
        return None
    layers = _expert_layers(entries)
    experts = sum(entries.count(b'"model.layers.%d.mlp.experts.' % layer) for layer in layers)
    return layers, experts, raw.count(b'"data_offsets"'), CodeCounts.in_entries(entries)


def same(raw, size):
    """Both readings of one header, every field and every dict in the same order; the dry run's counts, where the
    bulk reading gives them, the regex's."""
    counted = counted_in_bulk(raw)
    if counted is not None:
        assert counted == counted_by_regex(raw)
        assert list(counted[3].counts.items()) == list(counted_by_regex(raw)[3].counts.items())
    fast, slow = linear_columns(raw, size), regex_linear_columns(raw, size)
    assert (fast is None) == (slow is None)
    if fast is not None:  # (the reference's sums per (expert, rank), folded per (K, rank) as fit places them)
        folded = slow.folded()
        assert fast == folded and [fast.prefix + name for name in fast.names.split(b'"')] == _NAME.findall(raw)
        assert fast.tensors == len(_NAME.findall(raw))
        assert list(fast.tiers.items()) == list(folded.tiers.items())
    return fast


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    found = []
    for at, changes in enumerate(VARIANTS):
        found += raw_headers(tiny_checkpoint(tmp_path_factory.mktemp(f"v{at}"), **changes))
    return found


def test_the_synth_s_shards_read_the_same_and_in_bulk(headers):
    read = [same(raw, size) for raw, size in headers]
    assert sum(found is not None for found in read) >= 2 * len(VARIANTS)
    linear = [raw for raw, size in headers if linear_columns(raw, size) is not None]
    assert all(layout(raw) is not None for raw in linear)  # (the bulk reading, not only the regex, answered)
    assert all(counted_in_bulk(raw) is not None for raw, _ in headers if canonical_entries(raw) is not None)
    for raw, size in headers:
        same(raw, size - 1)  # tensors past the end


_NAME = re.compile(rb'"([^"]*)":\{"dtype"')
_OFFSETS = re.compile(rb'"data_offsets":\[([0-9]+),([0-9]+)\]')
_SHAPE = re.compile(rb'"shape":\[([0-9,]*)\]')


def _spans(pattern, raw, group=1):
    return [m.span(group) for m in pattern.finditer(raw)]


def _put(raw, span, text):
    return raw[:span[0]] + text + raw[span[1]:]


def _last_offsets(raw, end):
    """The last entry's end offset written as `end`, the trailing spaces dropped (no byte after its `]}}`)."""
    m = list(_OFFSETS.finditer(raw))[-1]
    return raw[:m.start(2)] + end + b"]}}"


def _last_pair(raw, pair):
    """The last entry's offsets written as `pair`, nothing after its `]}}`."""
    m = list(_OFFSETS.finditer(raw))[-1]
    return raw[:m.start(1)] + pair + b"]}}"


def _mutations(rng, raw):
    names = _spans(_NAME, raw)
    name = lambda: rng.choice(names)  # noqa: E731
    text = lambda span: raw[span[0]:span[1]]  # noqa: E731
    offsets = [m for m in _OFFSETS.finditer(raw)]
    shapes = _spans(_SHAPE, raw)

    def swap():
        a, b = sorted(rng.sample(names, 2))
        return raw[:a[0]] + text(b) + raw[a[1]:b[0]] + text(a) + raw[b[1]:]

    def twice():
        a, b = rng.sample(names, 2)
        return _put(raw, b, text(a))

    def edit_name(old, new):
        def go():
            span = name()
            return _put(raw, span, text(span).replace(old, new, 1))
        return go

    def at_random(piece):
        def go():
            at = rng.randrange(len(raw) + 1)
            return raw[:at] + piece + raw[at:]
        return go

    def offset(fn):
        def go():
            m = rng.choice(offsets)
            return _put(raw, m.span(0), b'"data_offsets":[' + fn(m.group(1), m.group(2)) + b"]")
        return go

    def shape(new):
        def go():
            return _put(raw, rng.choice(shapes), new)
        return go

    return [
        swap, twice, at_random(b" "), at_random(b'"'), at_random(b"."), at_random(b"\xc3\xa9"), at_random(b","),
        at_random(b"\\u006d"), edit_name(b"m", b"\\u006d"), edit_name(b"model", b"mod\xc3\xa9l"),
        edit_name(b".rank", b"."), edit_name(b".rank0.", b".rank00."), edit_name(b".rank1.", b".rank01."),
        edit_name(b"experts.1", b"experts.01"), edit_name(b"experts.", b"experts.12345678901234567890"),
        edit_name(b"layers.3", b"layers.4"), edit_name(b"layers.3", b"layers.03"),
        edit_name(b".mlp.experts.", b".mlp."), edit_name(b"model.layers.3", b"model.layers.3x"),
        edit_name(b".trellis", b".x.trellis"), edit_name(b"model.layers.", b"model.layers.."),
        lambda: _put(raw, name(), b"data_offsets"), lambda: raw.replace(b'"I16"', b'"U16"', 1),
        edit_name(b"gate_proj", b"gates_proj"), edit_name(b"up_proj", b"upp_proj"), edit_name(b".trellis", b".trelli"),
        edit_name(b".mul1", b".mul2"), edit_name(b".suh", b".su"), edit_name(b".su", b".s"), edit_name(b".", b".."),
        edit_name(b"model.layers", b"model.layers.3.mlp.experts.0.gate_proj.rank0.trellis.model.layers"),
        edit_name(b"proj.rank", b"proj.rank99999999999999999999"), edit_name(b"down_proj", b"down_proj.x"),
        offset(lambda a, b: b + b"," + a if a != b else a + b",0"), offset(lambda a, b: b"0" + a + b"," + b),
        offset(lambda a, b: a + b"," + b"9" * 19), offset(lambda a, b: a + b"," + b"9" * 18),
        offset(lambda a, b: a + b"," + b"1" + b"0" * 16), offset(lambda a, b: a + b" ," + b),
        offset(lambda a, b: a + b",," + b), offset(lambda a, b: b"," + b),
        shape(b"[1,2,3,4]"), shape(b"[123456]"), shape(b"[07]"), shape(b"[]"), shape(b"[16,16,32]"), shape(b"[1,,2]"),
        lambda: raw.replace(b'"I16"', b'"I17"', 1), lambda: raw.replace(b'"I16"', b'"F32"', 1),
        lambda: raw.replace(b'"dtype":', b'"dtype" :', 1), lambda: raw.replace(b']}', b'],"x":1}', 1),
        lambda: raw.rstrip(b" ")[:-1] + b"  ", lambda: raw.rstrip(b" ") + b"x", lambda: raw + b"        " * 5,
        lambda: raw.rstrip(b" "), lambda: _last_offsets(raw, b"9" * 17), lambda: _last_offsets(raw, b"9" * 30),
        lambda: _last_offsets(raw, b"12345678") + b" ", lambda: _last_offsets(raw, b"1234567"),
        lambda: _last_pair(raw, b"4,0"), lambda: _last_pair(raw, b"0,4"), lambda: _last_pair(raw, b"0,4") + b" ",
        lambda: _last_pair(raw, b"0,4") + b"  ", lambda: _last_pair(raw, b"10,4") + b" ",
        lambda: _last_pair(raw, b"12345678,0"), lambda: _last_pair(raw, b"1234567812345678,0"),
        lambda: _last_pair(raw, b"0,4").replace(b'"data_offsets":[0,4]}}', b'"d":[0,4]}}'),
        lambda: _last_pair(raw, b"0,4").replace(b'"data_offsets":[0,4]}}', b'"":[0,4]}}'),
        lambda: raw.replace(b'{"__metadata__":{', b'{"__metadata__":{"format":"x",', 1),
        lambda: raw.replace(b'{"__metadata__":{"format":"pt"},', b"{", 1),
        lambda: _put(raw, name(), b"__metadata__"), lambda: _put(raw, name(), b""),
        lambda: _put(raw, name(), b"lm_head.weight"), lambda: _put(raw, name(), b"a\x1fb"),
        lambda: raw[:rng.randrange(len(raw))], lambda: _put(raw, (k := rng.randrange(len(raw)), k + 1),
                                                           bytes([rng.randrange(256)])),
    ]


def test_huge_offsets_sum_the_same(headers):
    """Every tensor at [0, 2^52 - 1) of a file that long: sums far past float64's exact integers, the same both ways."""
    raw, size = next((raw, size) for raw, size in headers if linear_columns(raw, size) is not None)
    found = same(_OFFSETS.sub(b'"data_offsets":[0,%d]' % ((1 << 52) - 1), raw), 1 << 60)
    assert found is not None and max(b for b, _ in found.tiers.values()) > 1 << 57


def _python_fold(k, rank, nbytes, gates):
    """The sums per (K, rank) as `ExpertColumns.folded` adds them: Python's integers, in first-reached order."""
    tiers: dict = {}
    for kk, r, b, g in zip(k.tolist(), rank.tolist(), nbytes.tolist(), gates.tolist()):
        key = (None if kk < 0 else kk, r)
        held = tiers.get(key, (0, 0))
        tiers[key] = (held[0] + int(b), held[1] + int(g))
    return tiers


def test_sums_past_int64_s_reach_are_python_s():
    """`_folded`'s sums per (K, rank), within int64's reach (numpy's) and past it (Python's integers), in the order
    the pairs first reach each (K, rank): as the reference's fold adds them."""
    rng = random.Random(7)
    pairs = 3000
    k = np.array([rng.choice([-1, 3, 4]) for _ in range(pairs)], dtype=np.int64)
    rank = np.array([rng.randrange(4) for _ in range(pairs)], dtype=np.int64)
    gates = np.array([float(rng.randrange(3)) for _ in range(pairs)])
    for bits in (50, 60):
        nbytes = np.array([float(rng.randrange(1 << bits)) for _ in range(pairs)])
        found = columns._folded(5, k, rank, nbytes, gates, pairs, lambda: b"x")
        expected = _python_fold(k, rank, nbytes, gates)
        assert list(found.tiers.items()) == list(expected.items())
        assert (max(b for b, _ in expected.values()) > 1 << 63) == (bits == 60)


@pytest.mark.parametrize("seed", range(6))
def test_changed_headers_read_the_same_either_way(headers, seed):
    rng = random.Random(seed)
    expert_shards = [(raw, size) for raw, size in headers if b".mlp.experts." in raw and b'"data_offsets"' in raw]
    proven = 0
    for raw, size in expert_shards:
        mutations = _mutations(rng, raw)
        for mutate in mutations if len(raw) < 1 << 16 else rng.sample(mutations, 6):  # (a large header: a few)
            changed = mutate()
            for _ in range(rng.randrange(2)):  # sometimes two changes
                changed = rng.choice(_mutations(rng, changed) if _NAME.search(changed) and
                                     len(_NAME.findall(changed)) > 1 and _OFFSETS.search(changed) and
                                     _SHAPE.search(changed) else [lambda: changed])()
            proven += same(changed, size + rng.choice([0, 0, 64, -1])) is not None
    assert proven  # (some changes keep a header the columns read: a swap, an offset within the file)


@pytest.mark.parametrize("case", list(READER_CORPUS))
def test_the_reader_corpus_reads_the_same_either_way(tmp_path, case):
    root = tiny_checkpoint(tmp_path, layers=(3, 4, 5, 6), non_expert="bf16")
    READER_CORPUS[case](root)
    for shard in sorted(root.glob("*.safetensors")):
        if not shard.is_file() or shard.is_symlink():
            continue
        data = shard.read_bytes()
        (n,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
        if 8 + n <= len(data):
            same(data[8:8 + n], len(data))
