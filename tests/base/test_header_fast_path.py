"""The parser's fast path (a header proven to be in safetensors' own layout, decoded without hooks) gives exactly
what the strict path gives: the same Header, or the same refusal, on fresh random headers and on each way a
header can leave that layout or break a rule the match does not see."""

from __future__ import annotations

import json
import random

import pytest

from trellis_cli import header, header_layout, header_records
from trellis_cli.header import HeaderError, parse_header
from trellis_cli.header_layout import canonical_header
from trellis_cli.header_records import DTYPE_BYTES


def random_header(rng: random.Random, tensors: int) -> dict:
    doc: dict = {"__metadata__": {"format": "pt", "note": f"n{rng.randrange(10**6)}"}} if rng.random() < 0.7 else {}
    cursor = 0
    for i in range(tensors):
        dtype = rng.choice(sorted(DTYPE_BYTES))
        shape = [rng.randrange(0, 300) for _ in range(rng.randrange(0, 4))]
        size = DTYPE_BYTES[dtype]
        for d in shape:
            size *= d
        name = f"model.layers.{rng.randrange(80)}.mlp.experts.{i}.gate_proj.rank{rng.randrange(8)}.trellis"
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + size]}
        cursor += size
    return doc


def text(doc: dict) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return body + b" " * random.Random(len(body)).randrange(8)


def both(raw: bytes, monkeypatch) -> tuple:
    def parse() -> object:
        try:
            return parse_header("x.safetensors", raw, len(raw), None)
        except HeaderError as e:
            return ("refused", str(e), e.code)
    fast = parse()
    with monkeypatch.context() as m:
        m.setattr(header, "parse_canonical", lambda *_a: None)  # (where parse_header looks the fast path up)
        strict = parse()
    return fast, strict


@pytest.mark.parametrize("seed", range(20))
def test_random_canonical_headers_parse_alike(monkeypatch, seed):
    rng = random.Random(1000 + seed)
    raw = text(random_header(rng, rng.randrange(1, 200)))
    assert canonical_header(raw)
    fast, strict = both(raw, monkeypatch)
    assert fast == strict and not isinstance(fast, tuple)
    assert list(fast.tensors.items()) == list(strict.tensors.items())  # the stored order too


@pytest.mark.parametrize("gap", [0, 16])
def test_entries_read_as_a_mapping_in_stored_order(monkeypatch, gap):
    """A header's entries (a list, its dict by name built on the first lookup) answer as the dict did; stored back
    to back, each entry's begin is the object of the end before it, and with gaps between them each its own."""
    doc = random_header(random.Random(7), 40)
    names = [name for name in doc if name != "__metadata__"]
    for i, name in enumerate(names):
        doc[name]["data_offsets"] = [x + gap * i for x in doc[name]["data_offsets"]]
    fast, strict = both(text(doc), monkeypatch)
    assert fast == strict and list(fast.tensors) == names and len(fast.tensors) == len(names)
    entries = list(fast.tensors.values())
    assert [e.name for e in entries] == names and list(fast.tensors.items()) == list(zip(names, entries))
    assert fast.tensors[names[3]] is entries[3] and names[5] in fast.tensors and "absent" not in fast.tensors
    assert fast.tensors.get("absent") is None and dict(fast.tensors) == dict(zip(names, entries))
    shared = [later.begin is earlier.end for earlier, later in zip(entries, entries[1:]) if earlier.end > 256]
    if gap:
        assert not any(shared)
    else:
        assert shared and all(shared)  # (ints up to 256 are one object anyway)


def _duplicate_name(raw: bytes) -> bytes:
    """The second entry written once more, before the first: a name twice in the top object."""
    first = raw.index(b',"model.') + 1
    second = raw.index(b',"model.', first) + 1
    end = raw.index(b"}", second) + 1
    return raw[:first] + raw[second:end] + b"," + raw[first:]


MUTATIONS = {
    "duplicate name": _duplicate_name,
    "duplicate metadata key": lambda raw: raw.replace(b'{"format":"pt",', b'{"format":"pt","format":"pt",', 1),
    "reversed offsets": lambda raw: raw.replace(b'"data_offsets":[0,', b'"data_offsets":[999999999,', 1),
    "escaped name": lambda raw: raw.replace(b'"model.', b'"\\u006dodel.', 1),
    "lone surrogate": lambda raw: raw.replace(b'"model.', b'"\\ud800model.', 1),
    "whitespace": lambda raw: raw.replace(b'":{"dtype"', b'": {"dtype"', 1),
    "big dimension": lambda raw: raw.replace(b'"shape":[', b'"shape":[1234567,', 1),
    "float": lambda raw: raw.replace(b'"data_offsets":[0,', b'"data_offsets":[0.0,', 1),
    "negative zero": lambda raw: raw.replace(b'"data_offsets":[0,', b'"data_offsets":[-0,', 1),
    "not utf-8": lambda raw: raw.replace(b'"model.', b'"\xffmodel.', 1),
    "unknown dtype": lambda raw: raw.replace(b'"dtype":"', b'"dtype":"X', 1),
    "metadata not a string": lambda raw: raw.replace(b'"format":"pt"', b'"format":7', 1),
    "entry named __metadata__": lambda raw: raw.replace(b'"model.', b'"__metadata__":{},"model.', 1),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("seed", range(3))
def test_every_way_out_of_the_layout_gets_the_strict_answer(monkeypatch, mutation, seed):
    rng = random.Random(2000 + seed)
    doc = random_header(rng, 30)
    doc.setdefault("__metadata__", {"format": "pt"})
    doc["__metadata__"] = {"format": "pt", **doc["__metadata__"]}
    doc = {"__metadata__": doc.pop("__metadata__"), **doc}
    first = next(k for k in doc if k != "__metadata__")
    doc[first]["data_offsets"] = [0, doc[first]["data_offsets"][1] - doc[first]["data_offsets"][0]]
    raw = MUTATIONS[mutation](text(doc))
    fast, strict = both(raw, monkeypatch)
    assert fast == strict


@pytest.mark.parametrize("text", ['{"a":1,"a":2}', '{"a":":x"}', '{"a" :1,"a":2}', '{"a":{"b":1,"b":2}}',
                                  '{"x":":","x":1}', '[":", ":"]', '{"a": 1, "b": 2}', '{"a": ":b", "a": 1}',
                                  '{"a"\n:1, "a"\t: 2}', '{":":1, ":":2}'])
def test_plain_json_keys_counted_in_the_text_decide_as_the_checked_path(text):
    from trellis_cli.header import JsonError, load_json

    try:
        checked = ("accepted", json.loads(text, object_pairs_hook=_no_twice))
    except JsonError:
        checked = ("refused", None)
    try:
        plain = ("accepted", load_json(text))
    except JsonError:
        plain = ("refused", None)
    assert plain == checked


def _no_twice(pairs):
    from trellis_cli.header import JsonError

    if len(dict(pairs)) != len(pairs):
        raise JsonError("twice")
    return dict(pairs)


@pytest.mark.parametrize("seed", range(4))
def test_names_in_any_script_parse_alike(monkeypatch, seed):
    """Names outside ASCII (valid UTF-8, unescaped, as safetensors writes them) keep their text and order."""
    rng = random.Random(3000 + seed)
    doc = random_header(rng, 40)
    renamed = {}
    for i, (name, entry) in enumerate(doc.items()):
        renamed[name if name == "__metadata__" else f"{rng.choice(['é', '中', 'ß', 'x'])}{i}.{name}"] = entry
    raw = json.dumps(renamed, separators=(",", ":"), ensure_ascii=False).encode()
    assert header_layout.parse_canonical("x.safetensors", raw, len(raw), None) is not None  # the fast path read it
    fast, strict = both(raw, monkeypatch)
    assert not isinstance(fast, tuple) and fast == strict
    assert list(fast.tensors.items()) == list(strict.tensors.items())


def test_headers_laid_out_alike_share_their_offsets():
    """Within `shared_offsets()` a header takes the int objects of the header read before it for the leading run
    of offsets the two share (fewer objects, the same values); what follows a tensor of another size is its own.
    Each header parses to what it parses to alone."""
    def shard(sizes: list[int]) -> bytes:
        doc, cursor = {}, 0
        for i, n in enumerate(sizes):
            doc[f"model.layers.3.mlp.experts.{i}.gate_proj.trellis"] = {
                "dtype": "I16", "shape": [n], "data_offsets": [cursor, cursor + 2 * n]}
            cursor += 2 * n
        return json.dumps(doc, separators=(",", ":")).encode()

    first, second = shard([300] * 40), shard([300] * 25 + [301] + [300] * 14)
    with header_layout.shared_offsets():
        a, b = (parse_header(f"{n}.safetensors", raw, len(raw), None) for n, raw in (("a", first), ("b", second)))
    alone = parse_header("b.safetensors", second, len(second), None)
    assert b == alone and list(b.tensors.items()) == list(alone.tensors.items())
    ends_a, ends_b = [e.end for e in a.tensors.values()], [e.end for e in b.tensors.values()]
    assert all(x is y for x, y in zip(ends_a[:25], ends_b[:25]))  # the shared leading run
    assert not any(x is y for x, y in zip(ends_a[25:], ends_b[25:]))  # past the grown tensor: every value differs
    assert [e.begin for e in b.tensors.values()][1:] == ends_b[:-1]
    assert not any(x is y for x, y in zip(ends_a, (e.end for e in alone.tensors.values())))  # outside: its own


def _strip_proof(h: header_records.Header) -> header_records.Header:
    from dataclasses import replace

    return replace(h, tensors=header_records.Entries(list(h.tensors.values())))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("fault", ["none", "hole", "overlap", "size", "start", "past-file", "empty-file"])
def test_the_tiling_proven_from_columns_is_the_per_tensor_walks(seed, fault):
    from trellis_cli.formats.safetensors_layout import _sound_end

    rng = random.Random(5000 + seed)
    doc = random_header(rng, rng.randrange(2, 60))
    names = [n for n in doc if n != "__metadata__"]
    victim = doc[names[rng.randrange(1, len(names))]]
    begin, end = victim["data_offsets"]
    if fault == "hole":
        victim["data_offsets"] = [begin + 2, end + 2]
    elif fault == "overlap" and begin >= 2:
        victim["data_offsets"] = [begin - 2, end - 2]
    elif fault == "size":
        victim["dtype"] = "I8" if victim["dtype"] != "I8" else "I16"
    elif fault == "start":
        for n in names:
            doc[n]["data_offsets"] = [o + 4 for o in doc[n]["data_offsets"]]
    raw = text(doc)
    last = max(doc[n]["data_offsets"][1] for n in names)
    file_size = 8 + len(raw) + last - (1 if fault == "past-file" else 0) if fault != "empty-file" else None
    parsed = parse_header("x.safetensors", raw, len(raw), file_size)
    proven = parsed.tensors.tiled_end
    assert (proven is not None) == (fault in ("none", "past-file", "empty-file") or (fault == "overlap" and begin < 2)
                                    or (fault == "size" and _same_size(victim)))
    assert _sound_end(parsed) == _sound_end(_strip_proof(parsed))
    assert parsed.data_end == _strip_proof(parsed).data_end  # (the proof's end is the last entry's, the largest)


def _same_size(entry: dict) -> bool:
    begin, end = entry["data_offsets"]
    size = DTYPE_BYTES[entry["dtype"]]
    for d in entry["shape"]:
        size *= d
    return end - begin == size
