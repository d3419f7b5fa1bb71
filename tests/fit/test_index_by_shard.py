"""A large index proven shard by shard while the shards are scanned (`reader.IndexProof`), by fit's columns and by the
full opening: where the index lists each shard's entries in one run, in the order the shards are read, it gives what
the rebuild after the scan gives (`reader._rebuilt_index`); on any other index (another order of the shards, sorted by
name, damaged) it gives nothing and that rebuild decides. fit's and validate's documents (or refusals) are the same
with it and without it, the scans forked or not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from corrupt import INDEX, rewrite_index, shuffled
from helpers import run_cli, tiny_checkpoint
from trellis_cli import sources
from trellis_cli.checkpoint import reader
from trellis_cli.sources import LocalSource


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """Four layers of experts and the other weights: five shards."""
    root = tiny_checkpoint(tmp_path_factory.mktemp("by-shard"), "good", layers=(3, 4, 5, 6), non_expert="bf16")
    (root / "MANIFEST.sha256").unlink()
    return root


def reordered(weight_map, key):
    items = sorted(weight_map.items(), key=key)
    weight_map.clear()
    weight_map.update(items)


def shard_order(weight_map, order):
    """The shards' runs in `order` (positions in the order the index first names them), each as written."""
    files = list(dict.fromkeys(weight_map.values()))
    rank = {file: order(files).index(file) for file in files}
    reordered(weight_map, lambda item: rank[item[1]])


def each_shard_reversed(weight_map):
    files = list(dict.fromkeys(weight_map.values()))
    items = [(name, file) for shard in files for name, file in reversed(weight_map.items()) if file == shard]
    weight_map.clear()
    weight_map.update(items)


def first(weight_map):
    return next(iter(weight_map))


def last_shard(weight_map):
    return list(weight_map.values())[-1]


def text_edit(edit):
    """An edit of the compact index's text."""
    def apply(root):
        rewrite_index(root, separators=(",", ":"))
        (root / INDEX).write_text(edit((root / INDEX).read_text()))
    return apply


def map_edit(edit, **dumps):
    return lambda root: rewrite_index(root, edit, **dumps)


CASES = {  # how the index is written again, whether it is proven shard by shard as the shards are read
    "as written": (lambda root: None, True),
    "compact": (map_edit(lambda _wm: None, separators=(",", ":")), True),
    "indent=2": (map_edit(lambda _wm: None, indent=2), True),
    "each shard's entries reversed": (map_edit(each_shard_reversed), True),
    "each shard sorted within": (map_edit(lambda wm: reordered(wm, lambda item: (item[1], item[0]))), True),
    "sorted by name": (map_edit(lambda _wm: None, sort_keys=True, indent=2), False),
    "the shards reversed": (map_edit(lambda wm: shard_order(wm, lambda files: files[::-1])), False),
    "the last shard first": (map_edit(lambda wm: shard_order(wm, lambda files: files[-1:] + files[:-1])), False),
    "two shards swapped": (map_edit(lambda wm: shard_order(wm, lambda files: [files[1], files[0], *files[2:]])),
                           False),
    "shuffled": (map_edit(shuffled), False),
    "a name dropped": (map_edit(lambda wm: wm.pop(first(wm))), False),
    "the last name dropped": (map_edit(lambda wm: wm.pop(list(wm)[-1])), False),
    "an extra name at the end": (map_edit(lambda wm: wm.update({"model.zz.extra": last_shard(wm)})), False),
    "a name pointing to another shard": (map_edit(lambda wm: wm.update({first(wm): last_shard(wm)})), False),
    "a name pointing to a missing file": (map_edit(lambda wm: wm.update({first(wm): "absent.safetensors"})), False),
    "a name with a space": (map_edit(lambda wm: wm.update({first(wm).replace(".", ". ", 1): wm.pop(first(wm))})),
                            False),
    "a name twice": (text_edit(lambda text: text.replace('"weight_map":{', '"weight_map":{' + text.split(
        '"weight_map":{', 1)[1].split(",", 1)[0] + ",", 1)), False),
    "an escaped letter in a name": (text_edit(lambda text: text.replace('"model.', '"\\u006dodel.', 1)), False),
    "an escaped letter in the last file": (text_edit(lambda text: text[::-1].replace(
        "-ledom", "d200u\\ledom", 1)[::-1]), False),
    "a tab between two entries": (text_edit(lambda text: text.replace('","', '",\t"', 1)), False),
    "spaces around the braces": (text_edit(lambda text: " " + text[:-2] + " } }  "), True),
    "a line break at the end": (text_edit(lambda text: text + "\n"), True),
    "the last byte cut": (text_edit(lambda text: text[:-1]), False),
    "a trailing comma": (text_edit(lambda text: text[:-2] + ",}}"), False),
    "something after it": (text_edit(lambda text: text + "x"), False),
    "no metadata": (text_edit(lambda text: "{" + text.split(",", 1)[1]), True),
    "metadata nested": (text_edit(lambda text: text.replace('"metadata":{', '"metadata":{"a":{"b":1},', 1)), False),
    "metadata of another total": (text_edit(lambda text: text.replace('"total_size":', '"total_size":1', 1)), True),
}


@pytest.fixture(params=list(CASES))
def case(request, good, tmp_path, monkeypatch):
    """(a copy of `good` with its index written again, whether it is proven shard by shard), the index above the
    JSON limit of sources as a production one is."""
    root = Path(shutil.copytree(good, tmp_path / "ckpt"))
    edit, by_shard = CASES[request.param]
    edit(root)
    monkeypatch.setattr(sources, "MAX_JSON_BYTES", (root / INDEX).stat().st_size - 1)
    return root, by_shard


def test_fit_s_columns_prove_the_index_as_the_rebuild_after_the_scan(case):
    root, by_shard = case
    source = LocalSource(root)
    files = reader.listing(source)
    with reader.IndexProof(source, files) as proof:
        shards = reader.shard_columns(source, files, lambda *_args: None, proof)
        assert shards is not None and shards.names() is not None
        proven = proof.proven(shards.names())
        named = reader.index_files(source, files, shards.names(), proof)
    whole = reader._rebuilt_index(source, files, shards.names())
    assert proven == (whole if by_shard else None)
    assert named == reader.index_files(source, files, shards.names())


def test_the_opening_proves_the_index_as_the_rebuild_after_the_scan(case):
    root, by_shard = case
    source = LocalSource(root)
    files = reader.listing(source)
    with reader.IndexProof(source, files) as proof:
        headers = reader.read_headers(source, files, lambda *_args: None, [],
                                      taken=lambda name, _header, names: proof.take(name, names))
        proof.finish()
    assert proof.proven(reader.shard_names(headers)) == \
        (reader._rebuilt_index(source, files, reader.shard_names(headers)) if by_shard else None)


def test_fit_and_validate_write_the_same_documents_without_it(case, capsys, monkeypatch):
    """With the proof shard by shard (the scans forked where a fork is safe here) and with every shard's proof left
    to after the scan (scanned in this process): the same bytes out."""
    root, _by_shard = case
    commands = [("fit", "--tp", "2", "--gpu", "h100", "--json"), ("validate", "--json")]

    def run():
        return [run_cli(capsys, command[0], str(root), *command[1:]) for command in commands]

    monkeypatch.setattr(reader, "PARALLEL_SHARDS", 2)
    with_it = run()
    monkeypatch.setattr(reader, "PARALLEL_SHARDS", 10**9)
    monkeypatch.setattr(reader.IndexProof, "take", lambda *_args: None)
    assert with_it == run()
    assert with_it[0][0] == 0 or with_it[0][2].startswith("error: ")  # (a refusal, named)
    json.loads(with_it[1][1])  # (validate's document, whatever its verdict)


def test_the_proof_answers_only_for_the_shards_it_took(good, monkeypatch):
    """Asked about other shards than it took (one left out, or one more), or having taken one twice, it answers
    nothing; the rebuild after the scan is then asked."""
    monkeypatch.setattr(sources, "MAX_JSON_BYTES", (good / INDEX).stat().st_size - 1)
    source = LocalSource(good)
    files = reader.listing(source)
    headers = reader.read_headers(source, files, lambda *_args: None, [])
    names = reader.shard_names(headers)
    last = list(names)[-1]

    def proven(taken, asked):
        with reader.IndexProof(source, files) as proof:
            for file in taken:
                proof.take(file, reader.ShardNames.of(headers[file].tensors))
            return proof.proven({file: names[file] for file in asked})

    assert proven(names, names) == reader._rebuilt_index(source, files, names) is not None
    assert proven(names, [file for file in names if file != last]) is None
    assert proven([file for file in names if file != last], names) is None
    assert proven([*names, last], names) is None


@pytest.mark.parametrize("file", ["model-layer-003.safetensors", "a\tb.safetensors", 'a"b.safetensors',
                                  "a\\b.safetensors", "\u00e9.safetensors", "a\x01b.safetensors", "a\x7fb.safetensors",
                                  "a\nb.safetensors"])
def test_plain_names_entries_are_proven_written_from_their_separators(good, file):
    """`_Gaps.written_around` (joined canonical names: only the separators read) gives what `written` gives of the
    whole text, for files that JSON escapes or that are not ASCII, separators with line breaks and tabs, one entry
    or many, the index's last entries or not."""
    source = LocalSource(good)
    files = reader.listing(source)
    shards = reader.shard_columns(source, files, lambda *_args: None)
    assert shards is not None
    found = next(iter(shards.linears.values()))
    for colon, comma in [(b":", b","), (b": ", b", "), (b" :\n", b",\n  "), (b"\t:\t", b"\r\n,\t")]:
        gaps = reader._Gaps(colon, comma)
        for count in (1, 2, found.tensors):
            names = reader.ShardNames.joined(b'"'.join(found.names.split(b'"')[:count]), count, found.prefix)
            assert names.plain
            for last in (False, True):
                after = gaps.after(file)
                end = after[:-1 - len(comma)] if last else after[:-1]
                text = b'"' + b"".join(names.joined_by(None, after)) + end
                assert gaps.written_around(after, end, count, last) == gaps.written(text, count, last) == \
                    (file.isascii() and file.isprintable() and '"' not in file and "\\" not in file or "\x7f" in file)


def test_an_order_picks_each_shard_s_own_names():
    """A writer's order learned once picks the names of each shard it is given: the same as picking them anew, for
    shards of the same names (kept from the shard before) and of other names alike, in any sequence."""
    shards = [b'"'.join(b"%d.%s" % (expert, field) for expert in experts for field in (b"a", b"bb", b"c"))
              for experts in ([0, 1, 2], [0, 1, 2], [3, 4, 5], [0, 1, 2], [7, 8, 9])]
    positions = [8, 0, 4, 2, 6, 1, 3, 7, 5]
    order = reader._Order(positions)
    for names in shards + shards[::-1]:
        parts = names.split(b'"')
        assert list(order.picked(names)) == [parts[at] for at in positions]
    assert list(reader._Order([2]).picked(b"a\"b\"c")) == [b"c"]


@pytest.mark.parametrize("names", [[b"model.layers.3.mlp.experts.0.a", b"model.layers.3.mlp.experts.1.b"],
                                   [b"model.layers.3.a", b"model.layers.30.b", b"model.layers.3.c"],
                                   [b"model.layers.3.a", b"model.layers.4.b", b"model.layers.3.c"],
                                   [b"x.a", b"y.b", b"x.c"], [b"model.norm"], [b"a", b"a.b", b"a"], [b"", b"a"]])
def test_names_after_their_shared_prefix_are_the_same_names(names):
    """`ShardNames.after_prefix` (the opening's joined names, split in a worker): every name is its prefix and its
    part, the prefix shared by all of them (or none), and the rebuilt entries are the names as joined."""
    joined = b'"'.join(names)
    found = reader.ShardNames.after_prefix(joined, len(names))
    assert found.plain and found.tensors == len(names)
    assert [found.prefix + part for part in found.names.split(b'"')] == names
    assert found.listed() == [name.decode() for name in names]
    after = b'":"f.safetensors","'
    assert b"".join(found.joined_by(None, after)) == after.join(names)
    assert all(name.startswith(found.prefix) for name in names)


@pytest.mark.parametrize("form", [{}, {"separators": (",", ":")}, {"sort_keys": True, "indent": 2}])
def test_fit_s_names_rebuild_the_index_as_the_headers_names(good, tmp_path, monkeypatch, form):
    """The names fit's columns keep (after their layer's prefix) rebuild an index written shard by shard or sorted
    by name as the parsed headers' names do: proven, with the same metadata."""
    root = Path(shutil.copytree(good, tmp_path / "ckpt"))
    rewrite_index(root, lambda _wm: None, **form)
    monkeypatch.setattr(sources, "MAX_JSON_BYTES", (root / INDEX).stat().st_size - 1)
    source = LocalSource(root)
    files = reader.listing(source)
    shards = reader.shard_columns(source, files, lambda *_args: None)
    assert shards is not None and shards.names() is not None
    headers = reader.shard_names(reader.read_headers(source, files, lambda *_args: None, []))
    assert reader._rebuilt_index(source, files, shards.names()) == reader._rebuilt_index(source, files, headers) \
        is not None
