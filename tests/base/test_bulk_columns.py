"""The bulk reads of a shard's header (`header_layout.canonical_columns`) and of its names' linears
(`linear_names.name_linears`) give exactly what their reference splits give (a match per entry, per name): the same
columns field by field, or None where the reference says None. On real headers written by synth for several presets,
on the headers of the reader's refusal corpus, and on many seeded perturbations of real headers and names."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from corrupt import READER_CORPUS
from helpers import to_plain_exl3
from trellis_cli import header_layout
from trellis_cli.checkpoint import linear_names
from trellis_cli.header_layout import canonical_columns
from trellis_cli.checkpoint.linear_names import name_linears
from trellis_cli.synth import preset, write_checkpoint


def same(found: tuple | None, expected: tuple | None) -> bool:
    if found is None or expected is None:
        return found is None and expected is None
    assert type(found) is type(expected)
    for a, b in zip(found, expected, strict=True):
        if isinstance(b, np.ndarray):
            if not (isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)):
                return False
        elif type(a) is not type(b) or a != b:
            return False
    return True


def reference_linears(text: str, count: int):
    """name_linears with the bulk read left out: the split by the pattern decides everything."""
    saved = linear_names._bulk_linears
    linear_names._bulk_linears = lambda *_a: None  # type: ignore[assignment]
    try:
        return name_linears(text, count)
    finally:
        linear_names._bulk_linears = saved


def check_columns(raw: bytes) -> bool:
    """canonical_columns(raw) is the reference's answer; True where the bulk read gave it."""
    found = canonical_columns(raw)
    assert same(found, header_layout._split_columns(raw)), raw[:200]
    return header_layout._layout_columns(raw) is not None


def check_linears(names: list[str]) -> bool:
    """name_linears of `names` is the reference's answer; True where the bulk read gave it."""
    text = "\n".join(names)
    found = name_linears(text, len(names))
    assert same(found, reference_linears(text, len(names))), names[:5]
    if not any('"' in name for name in names):  # joined by quotes, as a canonical header's columns join them
        assert same(name_linears('"'.join(names), len(names), '"'), found), names[:5]
    return bool(names) and text.isascii() and linear_names._bulk_linears(text, len(names)) is not None


def header_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(min(n, 1 << 30))


def shard_headers(root: Path) -> list[bytes]:
    return [header_bytes(p) for p in sorted(root.rglob("*.safetensors")) if p.is_file() and not p.is_symlink()]


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> list[bytes]:
    """Headers of synth checkpoints: tiny (ranked, with every other weight), tiny with more experts, a small glm52-tp4
    (sparse), and tiny as plain exllamav3 names (no rank)."""
    base = tmp_path_factory.mktemp("bulk")
    roots = [write_checkpoint(base / "tiny", preset("tiny")),
             write_checkpoint(base / "wide", replace(preset("tiny"), sparse=True, experts=64, partition=(40, 24))),
             write_checkpoint(base / "glm52", replace(preset("glm52-tp4"), sparse=True, experts=8, partition=(6, 2),
                                                      layers=(3, 4)))]
    plain = write_checkpoint(base / "plain", replace(preset("tiny"), tp=1))
    roots.append(to_plain_exl3(plain))
    return [raw for root in roots for raw in shard_headers(root)]


def names_of(raw: bytes) -> list[str]:
    columns = canonical_columns(raw)
    assert columns is not None
    return columns.names.split('"')


def test_real_headers_are_read_in_bulk_alike(real):
    assert all(check_columns(raw) for raw in real)
    bulk = [check_linears(names_of(raw)) for raw in real]
    assert sum(bulk) >= 4  # the expert shards of each preset took the bulk read


def test_the_refusal_corpus_headers_read_alike(tmp_path):
    for case, damage in READER_CORPUS.items():
        root = write_checkpoint(tmp_path / case, replace(preset("tiny"), sparse=True))
        damage(root)
        for path in sorted(root.glob("*.safetensors")):
            if path.is_file() and path.stat().st_size >= 8:
                try:
                    raw = header_bytes(path)
                except OSError:
                    continue
                check_columns(raw)


# ---- perturbed headers ---------------------------------------------------------------------------------------------

def entries_text(doc: dict) -> list[bytes]:
    return [json.dumps({k: v}, separators=(",", ":")).encode()[1:-1] for k, v in doc.items()]


def assemble(meta: bytes | None, entries: list[bytes], pad: int = 0) -> bytes:
    head = b"{" + (meta + b"," if meta is not None else b"")
    return head + b",".join(entries) + b"}" + b" " * pad


def perturbed_header(rng: random.Random, raw: bytes) -> bytes:
    doc = json.loads(raw)
    meta_doc = doc.pop("__metadata__", None)
    meta = None if meta_doc is None else b'"__metadata__":' + json.dumps(meta_doc, separators=(",", ":")).encode()
    entries = entries_text(doc)
    i, j = rng.randrange(len(entries)), rng.randrange(len(entries))
    e = entries[i]
    op = rng.randrange(25)
    if op == 0:
        entries[i], entries[j] = entries[j], entries[i]
    elif op == 1:  # a name twice
        entries[i] = entries[j].split(b'":{', 1)[0] + b'":{' + e.split(b'":{', 1)[1]
    elif op == 2:
        entries[i] = e.replace(b":", b": ", 1) if rng.random() < 0.5 else e.replace(b",", b" ,", 1)
    elif op == 3:
        entries[i] = e.replace(b"m", b"\\u006d", 1)
    elif op == 4:
        entries[i] = e.replace(b"model", "mod\u00e9l".encode(), 1)
    elif op == 5:  # reversed offsets
        entries[i] = e[:e.rindex(b"[")] + b"[" + b",".join(e[e.rindex(b"[") + 1:-2].split(b",")[::-1]) + b"]}"
    elif op == 6:  # huge offsets
        big = rng.choice([10**17, 10**18 - 1, 10**18, 2**63, 2**64])
        entries[i] = e[:e.rindex(b"[")] + f"[{big},{big}]}}".encode()
    elif op == 7:  # an extra field
        entries[i] = e[:-1] + b',"extra":1}'
    elif op == 8:
        cut = rng.randrange(1, e.index(b'":{'))
        entries[i] = e[:cut] + rng.choice([b'"', b"\\n", b".", b"\n", b"\x00", b"\x7f", b"}", b"]", b","]) + e[cut:]
    elif op == 9:  # leading zeros
        entries[i] = e.replace(b"[", b"[0", 1) if rng.random() < 0.5 else e[:e.rindex(b"[") + 1] + b"0" + \
            e[e.rindex(b"[") + 1:]
    elif op == 10:
        entries[i] = e.replace(b'"shape":[', b'"shape":[100000,', 1)
    elif op == 11:
        entries[i] = e.replace(b'"shape":[', b'"shape":[1,2,3,', 1)
    elif op == 12:
        entries[i] = e.replace(b'"dtype":"', b'"dtype":"X', 1)
    elif op == 13:
        entries[i] = b'"__metadata__"' + e[e.index(b'":{') + 1:]
    elif op == 14:
        meta = b'"__metadata__":{"format":"pt","x":"a},{b","data_offsets":"\\""}' if rng.random() < 0.3 else \
            b'"__metadata__":{"format":"pt","note":"a}b,\\"c"}'.replace(b'\\"', b"") if rng.random() < 0.5 else None
    elif op == 15:  # fields in another order
        entries[i] = e.replace(b'"dtype"', b'"dtypf"', 1) if rng.random() < 0.3 else \
            e.split(b'":{', 1)[0] + b'":{' + b",".join(e.split(b'":{', 1)[1][:-1].split(b",")[::-1]) + b"}"
    elif op == 16:
        del entries[i]
    elif op == 17:
        entries.insert(i, b'"":{"dtype":"I8","shape":[],"data_offsets":[0,1]}')
    elif op == 18:
        entries = entries[:1]
    elif op == 24:  # a long name (its distinctness proven by a set), or two
        long = b"x" * rng.choice([121, 200])
        entries[i] = long + e
        if rng.random() < 0.5:
            entries[j] = long + entries[i][len(long):] if i != j else e
    elif op == 23:  # a leading zero in an end
        begin, end = e[e.rindex(b"[") + 1:-2].split(b",")
        entries[i] = e[:e.rindex(b"[") + 1] + begin + b",0" + end + b"]}"
    raw = assemble(meta, entries, rng.randrange(3))
    if op == 19:  # a byte changed
        k = rng.randrange(len(raw))
        raw = raw[:k] + bytes([rng.randrange(256)]) + raw[k + 1:]
    elif op == 20:
        k = rng.randrange(len(raw))
        raw = raw[:k] + raw[k + 1:]
    elif op == 21:
        raw = raw + b"x" if rng.random() < 0.5 else raw.rstrip(b" ")[:-1]
    elif op == 22:
        raw = b" " + raw
    return raw


def test_perturbed_headers_read_alike(real):
    rng = random.Random(20261207)
    small = sorted(real, key=len)[:6]
    bulk = 0
    for _ in range(600):
        bulk += check_columns(perturbed_header(rng, rng.choice(small)))
    assert bulk > 50  # many perturbations keep the layout: the bulk read answered them


# ---- perturbed names -----------------------------------------------------------------------------------------------

def perturbed_names(rng: random.Random, names: list[str]) -> list[str]:
    names = list(names)
    for _ in range(rng.choice([1, 1, 2, 3])):
        i, j = rng.randrange(len(names)), rng.randrange(len(names))
        name = names[i]
        op = rng.randrange(20)
        if op == 0:
            names[i], names[j] = names[j], names[i]
        elif op == 1:
            names[i] = names[j]
        elif op == 2:  # rank-less here
            names[i] = ".".join(part for part in name.split(".") if not part.startswith("rank"))
        elif op == 3:  # rank-less everywhere
            names = [".".join(p for p in n.split(".") if not p.startswith("rank")) for n in names]
        elif op == 4:
            names[i] = name.rsplit(".", 1)[0] + rng.choice([".bias", ".weight", ".mul2", ".trellis.x", ".su."])
        elif op == 5:
            names[i] = name.replace("layers.", f"layers.{rng.choice(['1', '77', '0', '99999'])}", 1)
        elif op == 6:
            names.insert(i, rng.choice(["model.embed_tokens.weight", "model.layers.3.mlp.gate.weight",
                                        "model.layers.3.mlp.experts.7.weight", "model.layers.3.mlp.experts.x"]))
        elif op == 7:
            k = rng.randrange(len(name) + 1)
            names[i] = name[:k] + rng.choice([".", "\n", '"', " ", "\x00", "\u00e9", "_", "0"]) + name[k:]
        elif op == 8:  # leading zeros in an id
            part = rng.choice(["layers.", "experts.", "rank"])
            names[i] = name.replace(part, part + "0", 1)
        elif op == 9:  # ids above the digit limits
            part, digits = rng.choice([("layers.", "100000"), ("experts.", "1000000"), ("rank", "10000"),
                                       ("layers.", "12345"), ("experts.", "654321"), ("rank", "9999")])
            head, _, tail = name.partition(part)
            names[i] = head + part + digits + tail[tail.index("."):] if "." in tail else name
        elif op == 10:
            names[i] = name.replace("_proj", rng.choice(["_projx", "proj", "_pro"]), 1)
        elif op == 11:
            names[i] = name.replace("up_proj", "gate_proj", 1).replace("down_proj", "up_proj", 1)
        elif op == 12:
            rng.shuffle(names)
        elif op == 13:
            names[i] = "x" + name if rng.random() < 0.5 else name + "x"
        elif op == 14:
            names[i] = name.replace(".mlp.", ".mlp.mlp.", 1)
        elif op == 15:
            names[i] = name.upper()
        elif op == 16:
            names = names[: rng.randrange(1, len(names) + 1)]
        elif op == 17:  # other layers and experts everywhere
            shift = rng.randrange(1, 1000)
            names = [n.replace("experts.", f"experts.{shift}", 1) for n in names]
        elif op == 18:
            names[i] = name.replace(".", "..", 1)
        elif op == 19:
            del names[i]
    return names


def test_perturbed_names_read_alike(real):
    rng = random.Random(7)
    expert_names = [names for names in map(names_of, real) if any(".mlp.experts." in n for n in names)]
    small = sorted(expert_names, key=len)[:6]
    bulk = 0
    for _ in range(800):
        bulk += check_linears(perturbed_names(rng, rng.choice(small)))
    assert bulk > 50
    assert not check_linears([])


def test_distinct_spans_tell_texts_apart_by_first_use():
    rng = random.Random(3)
    for _ in range(200):
        pieces = [bytes(rng.choice(b"ab\x01\xff.") for _ in range(rng.randrange(0, 17))) for _ in range(6)]
        chosen = [rng.choice(pieces) for _ in range(rng.randrange(1, 40))]
        data = np.frombuffer(b"".join(chosen), dtype=np.uint8)
        ends = np.cumsum([len(p) for p in chosen])
        found = header_layout.distinct_spans(data, ends - [len(p) for p in chosen], ends, 16)
        assert found is not None
        first, position = found
        order = list(dict.fromkeys(chosen))
        assert [chosen[at] for at in first.tolist()] == order
        assert position.tolist() == [order.index(p) for p in chosen]


@pytest.mark.parametrize("count", [5, 31, 32, 90])
def test_many_kinds_keep_the_order_of_first_use(count):
    """More distinct kinds than the bulk read groups one at a time (32; it sorts them then): still in order of first
    use, each entry's position among them the reference's."""
    rng = random.Random(count)
    kinds = [("F16", [])] + [(rng.choice(["F16", "BF16", "I32", "F8_E4M3"]),
                              [at + 1] + [rng.randrange(0, 99999) for _ in range(rng.randrange(3))])
                             for at in range(count)]  # (count + 1 distinct kinds)
    chosen = kinds + [rng.choice(kinds) for _ in range(3 * count)]
    rng.shuffle(chosen)
    doc = {f"t.{i}": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}
           for i, (dtype, shape) in enumerate(chosen)}
    raw = assemble(None, entries_text(doc), pad=3)
    assert check_columns(raw)
    columns = canonical_columns(raw)
    assert columns is not None and len(columns.kinds) == count + 1
