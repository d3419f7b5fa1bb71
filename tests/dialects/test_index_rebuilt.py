"""A large index proven by writing it again from the headers (`reader._rebuilt_index`): on every dialect's synth,
as its writer wrote it, sorted by name, indented, with an order of its own per shard, shuffled and damaged, the
opening builds the same model and validate writes the same document as with the streamed proof alone and as with
the index read in full. Where the bytes are not the rebuilt text it declines, and the streamed proof or the full
read decides, with the same findings. The opening proves it shard by shard as the headers are read
(`reader.IndexProof`) where the index lists the shards in that order: the same answer as the rebuild after the scan
gives, or none (and then that rebuild decides), with the same model and document either way."""

from __future__ import annotations

import json

import pytest

from corrupt import INDEX, rewrite_index, shuffled
from helpers import run_cli, tiny_checkpoint, to_plain_exl3, to_r7, to_r7_v2
from trellis_cli import sources
from trellis_cli.checkpoint import reader
from trellis_cli.dialects import open_checkpoint
from trellis_cli.sources import LocalSource
from trellis_cli.validate.request import validate_source



def glm53(tmp_path):
    code, _, _ = run_cli(None, "synth", str(tmp_path / "glm53"), "--preset", "glm53-tiny")
    assert code == 0
    return tmp_path / "glm53"


DIALECTS = {
    "tr3": lambda tmp_path: tiny_checkpoint(tmp_path),
    "tr3-shared-h": lambda tmp_path: tiny_checkpoint(tmp_path, rotation_layout="shared_h_v1", uniform_k=4,
                                                     partition=None),
    "exl3": lambda tmp_path: to_plain_exl3(tiny_checkpoint(tmp_path, tp=1)),
    "r7": lambda tmp_path: to_r7(tiny_checkpoint(tmp_path, tp=1)),
    "r7-v2": lambda tmp_path: to_r7_v2(tiny_checkpoint(tmp_path, tp=1)),
    "glm53": glm53,
}


def opened(root):
    """What the opening and validate make of `root`: the index as the model holds it, the tensors' files, the
    findings met while parsing, and validate's whole document."""
    ckpt = open_checkpoint(root)
    model = (ckpt.index_file, None if ckpt.index is None else sorted(ckpt.index.items()), ckpt.index_metadata,
             ckpt.index_agrees, {name: ref.file for name, ref in ckpt.tensors.items()},
             [(f.code, f.message, f.where, f.expected, f.found) for f in ckpt.parse_findings])
    return model, json.dumps(validate_source(root).to_dict(), sort_keys=True, default=str)


def every_way(root, monkeypatch):
    """(what the rebuild proves, what it proves shard by shard as the headers are read (`reader.IndexProof`), the
    opening with both, with the rebuild after the scan alone, with the streamed proof alone, with the index read in
    full): all but the last with the index above the JSON limit, as a production one is."""
    with monkeypatch.context() as m:
        m.setattr(sources, "MAX_JSON_BYTES", (root / INDEX).stat().st_size - 1)
        source = LocalSource(root)
        files = reader.listing(source)
        ckpt = open_checkpoint(root)
        names = reader.shard_names(ckpt.headers)
        proven = reader._rebuilt_index(source, files, names)
        with reader.IndexProof(source, files) as proof:
            reader.read_headers(source, files, lambda *_args: None, [],
                                taken=lambda name, _header, names: proof.take(name, names))
            by_shard = proof.proven(names)
        rebuilt = opened(root)
        m.setattr(reader.IndexProof, "take", lambda *_args: None)  # every shard's proof left to after the scan
        whole = opened(root)
        m.setattr(reader, "_rebuilt_index", lambda *_args: None)
        streamed = opened(root)
    return proven, by_shard, rebuilt, whole, streamed, opened(root)


def same_every_way(root, monkeypatch, by_shard: bool | None = None):
    """What the rebuild proves, after checking that the ways agree (and, where it proves the index, that it is the
    index's own metadata, read in full), that the proof shard by shard gives the same or nothing and, with
    `by_shard`, whether it proves it."""
    proven, shard_by_shard, rebuilt, whole, streamed, full = every_way(root, monkeypatch)
    assert rebuilt == whole == streamed == full
    if proven is not None:
        assert proven == (INDEX, json.loads((root / INDEX).read_text()).get("metadata", {}))
    assert shard_by_shard in (None, proven)
    if by_shard is not None:
        assert (shard_by_shard is not None) == by_shard
    return proven


def reordered(weight_map, key):
    items = sorted(weight_map.items(), key=key)
    weight_map.clear()
    weight_map.update(items)


def each_shard_its_own_order(weight_map):
    """Shard after shard in the order the index first names them; alternately reversed and sorted within."""
    shards = list(dict.fromkeys(weight_map.values()))
    items = []
    for i, shard in enumerate(shards):
        names = [name for name, file in weight_map.items() if file == shard]
        items += [(name, shard) for name in (names[::-1] if i % 2 else sorted(names))]
    weight_map.clear()
    weight_map.update(items)


FORMS = {  # (how the index is written again, whether the rebuild proves it)
    "as written": ({}, True),
    "compact": (dict(separators=(",", ":")), True),
    "indent=2": (dict(indent=2), True),
    "sorted, compact": (dict(sort_keys=True, separators=(",", ":")), True),
    "sorted, indent=2": (dict(sort_keys=True, indent=2), True),  # as transformers writes one
}


# The dialects whose writer lists the shards in the order they are read (the listing's): proven shard by shard as they
# are read unless sorted by name. exl3's and r7-v2's list the other weights' shard first, glm53's is sorted by name.
IN_READ_ORDER = {"tr3", "tr3-shared-h", "r7"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_dialect_in_every_writer_form_is_proven_the_same(tmp_path, monkeypatch, dialect, form):
    root = DIALECTS[dialect](tmp_path)
    dumps, proves = FORMS[form]
    if dumps:
        rewrite_index(root, **dumps)
    by_shard = dialect in IN_READ_ORDER and "sorted" not in form
    assert (same_every_way(root, monkeypatch, by_shard) is not None) == proves


def shards_reversed(weight_map):
    """The shards' runs in the reverse of the order they are read, each shard's entries as written."""
    files = list(dict.fromkeys(weight_map.values()))
    reordered(weight_map, lambda item: -files.index(item[1]))


def last_shard_first(weight_map):
    last = list(dict.fromkeys(weight_map.values()))[-1]
    reordered(weight_map, lambda item: item[1] != last)


@pytest.mark.parametrize("order, proves, by_shard", [
    (lambda wm: reordered(wm, lambda item: (item[1], item[0])), True, True),  # shard by shard, sorted within
    (each_shard_its_own_order, True, True),
    (shards_reversed, True, False),  # (the rebuild after the scan proves these)
    (last_shard_first, True, False),
    (lambda wm: reordered(wm, lambda item: item[0][::-1]), False, False),  # the shards' entries interleaved
    (shuffled, False, False),
])
@pytest.mark.parametrize("indent", [None, 2])
def test_orders_other_than_a_writers_are_left_to_the_streamed_proof(tmp_path, monkeypatch, order, proves, by_shard,
                                                                    indent):
    root = tiny_checkpoint(tmp_path)
    rewrite_index(root, order, indent=indent)
    assert (same_every_way(root, monkeypatch, by_shard) is not None) == proves


def first(weight_map):
    return next(iter(weight_map))


def other_shard(weight_map):
    return next(file for file in weight_map.values() if file != weight_map[first(weight_map)])


MAP_EDITS = {
    "a name dropped": lambda wm: wm.pop(first(wm)),
    "the last name dropped": lambda wm: wm.pop(list(wm)[-1]),
    "a name moved to another shard": lambda wm: wm.update({first(wm): other_shard(wm)}),
    "an extra name": lambda wm: wm.update({"model.layers.3.mlp.experts.0.up_proj.extra": other_shard(wm)}),
    "an extra name first": lambda wm: reordered(wm.update({"a": other_shard(wm)}) or wm, lambda item: item[0] != "a"),
    "a missing shard": lambda wm: wm.update({first(wm): "missing.safetensors"}),
    "a path leaving the checkpoint": lambda wm: wm.update({first(wm): "../outside.safetensors"}),
    "a name with a space": lambda wm: wm.update({first(wm).replace(".", ". ", 1): wm.pop(first(wm))}),
    "a name not ASCII": lambda wm: wm.update({first(wm).replace("l", "\u013e", 1): wm.pop(first(wm))}),
    "a name with a quote": lambda wm: wm.update({first(wm) + '"': wm.pop(first(wm))}),
}


@pytest.mark.parametrize("edit", MAP_EDITS)
@pytest.mark.parametrize("form", ["compact", "sorted, indent=2"])
def test_an_index_that_disagrees_is_not_proven_and_reads_the_same(tmp_path, monkeypatch, edit, form):
    root = tiny_checkpoint(tmp_path)
    rewrite_index(root, MAP_EDITS[edit], **FORMS[form][0])
    assert same_every_way(root, monkeypatch) is None


def text_of(root):
    return (root / INDEX).read_text()


def first_name(text):
    return text.split('"weight_map":{"', 1)[1].split('"', 1)[0]


TEXT_EDITS = {  # on the compact index as the writer writes it
    "a name twice": lambda text: text.replace('"weight_map":{', f'"weight_map":{{"{first_name(text)}":"x.st",'),
    "a name twice, same shard": lambda text: text.replace(
        '"weight_map":{', '"weight_map":{' + text.split('"weight_map":{', 1)[1].split(",", 1)[0] + ",", 1),
    "a tab inside a name": lambda text: text.replace('"model.', '"model.\t', 1),
    "a line break inside a name": lambda text: text.replace('"model.', '"model.\n', 1),
    "an escaped letter in a name": lambda text: text.replace('"model.', '"\\u006dodel.', 1),
    "an escaped letter in a file": lambda text: text.replace('"model-', '"model\\u002d', 1),
    "a trailing comma": lambda text: text[:-2] + ",}}",
    "the last byte cut": lambda text: text[:-1],
    "cut in half": lambda text: text[:len(text) // 2],
    "a line break at the end": lambda text: text + "\n",
    "spaces around the braces": lambda text: " " + text.replace('"weight_map":{', '"weight_map": {  ')[:-2] + " } }  ",
    "something after it": lambda text: text + "x",
    "a second object after it": lambda text: text + "{}",
    "no metadata": lambda text: "{" + text.split(",", 1)[1],
    "metadata of another total": lambda text: text.replace('"total_size":', '"total_size":1', 1),
    "metadata nested": lambda text: text.replace('"metadata":{', '"metadata":{"a":{"b":1},', 1),
    "metadata a list": lambda text: '{"metadata":[1],' + text.split("},", 1)[1],
    "metadata a key twice": lambda text: text.replace('"metadata":{', '"metadata":{"total_size":0,', 1),
    "metadata with an escape": lambda text: text.replace('"metadata":{', '"metadata":{"n\\u0061me":"x",', 1),
    "metadata after the map": lambda text: '{"weight_map":' + text.split('"weight_map":', 1)[1][:-1] + ',' +
    text.split(',"weight_map"', 1)[0][1:] + "}",
    "another key": lambda text: text.replace('"weight_map":{', '"other":1,"weight_map":{', 1),
    "the map twice": lambda text: text[:-1] + ',"weight_map":{}}',
    "a value not a string": lambda text: text.replace('.safetensors"', '.safetensors",1:2', 1),
}


@pytest.mark.parametrize("edit", TEXT_EDITS)
def test_a_damaged_index_reads_the_same_every_way(tmp_path, monkeypatch, edit):
    root = tiny_checkpoint(tmp_path)
    rewrite_index(root, separators=(",", ":"))
    (root / INDEX).write_text(TEXT_EDITS[edit](text_of(root)))
    proves = edit in {"a line break at the end", "spaces around the braces", "no metadata", "metadata of another total"}
    assert (same_every_way(root, monkeypatch, by_shard=proves) is not None) == proves


def test_a_name_in_two_shards_is_not_proven_and_reads_the_same(tmp_path, monkeypatch):
    """The index may name either copy; the rebuild, which would write the name twice, leaves both to the others."""
    from safetensors.torch import load_file, save_file

    root = tiny_checkpoint(tmp_path)
    shards = sorted(root.glob("*.safetensors"))
    a, b = load_file(shards[0]), load_file(shards[-1])
    name = sorted(a)[0]
    save_file({**b, name: a[name]}, shards[-1])
    for owner in (shards[0].name, shards[-1].name):
        rewrite_index(root, lambda wm: wm.update({name: owner}))
        assert same_every_way(root, monkeypatch) is None


def test_a_shard_written_in_two_runs_is_not_proven(tmp_path, monkeypatch):
    root = tiny_checkpoint(tmp_path)

    def split_first_shard(weight_map):
        items = list(weight_map.items())
        moved = items.pop(0)
        weight_map.clear()
        weight_map.update(items[:len(items) // 2] + [moved] + items[len(items) // 2:])

    rewrite_index(root, split_first_shard)
    assert same_every_way(root, monkeypatch) is None


@pytest.mark.parametrize("odd, proves", [
    ("\t", False), ("\n", False), ("\x00", False), ('"', False), ("\\", False),  # not JSON unless escaped
    ("\u00e9", False), ("\x7f", True),  # JSON as they are: left to the others (not ASCII), proven (written as is)
])
def test_a_name_written_without_its_escape_is_not_proven(tmp_path, monkeypatch, odd, proves):
    """A header name that JSON escapes, written in the index as it is (as a careless writer would): the rebuilt text
    equals those bytes, so only the check that no name needs an escape keeps the rebuild from proving it (the head
    read in pieces that end before the name, as a production index's first piece does)."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setattr(reader, "_INDEX_PIECE", 64)

    root = tiny_checkpoint(tmp_path)
    shard = next(p for p in sorted(root.glob("*.safetensors")) if not p.name.startswith("model-layer-"))
    tensors = load_file(shard)
    name = f"model.zz{odd}odd.weight"
    save_file({**tensors, name: next(iter(tensors.values())).clone()}, shard, metadata={"format": "pt"})
    doc = json.loads(text_of(root))
    weight_map = sorted({**doc["weight_map"], name: shard.name}.items())
    entries = ",".join(f'"{n}":"{f}"' for n, f in weight_map)
    (root / INDEX).write_text('{"metadata":%s,"weight_map":{%s}}' % (json.dumps(doc["metadata"]), entries))
    assert (same_every_way(root, monkeypatch) is not None) == proves
