"""The opening's large index: one proven in its bytes to map every tensor to the file holding it is taken as that
mapping without decoding it (`reader.index_of`); any other is decoded and compared as a small one is. Both ways
give the same model and the same validate document, on good indexes and on every disagreement."""

from __future__ import annotations

import json

import pytest

from helpers import tiny_checkpoint
from trellis_cli import sources
from trellis_cli.checkpoint import reader
from trellis_cli.dialects import open_checkpoint
from trellis_cli.sources import LocalSource
from trellis_cli.validate.request import validate_source

INDEX = "model.safetensors.index.json"


def opened(root):
    """What the opening and validate make of `root`: the index as the model holds it, the tensors' files, the
    findings met while parsing, and validate's whole document."""
    ckpt = open_checkpoint(root)
    model = (ckpt.index_file, None if ckpt.index is None else list(ckpt.index.items()), ckpt.index_metadata,
             {name: ref.file for name, ref in ckpt.tensors.items()},
             [(f.code, f.message, f.where, f.expected, f.found) for f in ckpt.parse_findings])
    return model, json.dumps(validate_source(root).to_dict(), sort_keys=True, default=str)


def both(root, monkeypatch):
    """(the index read as a large one, as a small one): the large way first, then the JSON limit restored."""
    with monkeypatch.context() as m:
        m.setattr(sources, "MAX_JSON_BYTES", (root / INDEX).stat().st_size - 1)
        large = opened(root)
    return large, opened(root)


def rewrite(root, edit):
    doc = json.loads((root / INDEX).read_text())
    edit(doc["weight_map"])
    (root / INDEX).write_text(json.dumps(doc))


def first(weight_map):
    return next(iter(weight_map))


@pytest.mark.parametrize("rebuilt", [True, False])  # (False: the streamed proof alone, for any index)
@pytest.mark.parametrize("piece", [8 << 20, 1, 5, 37, 101])
def test_an_index_that_agrees_is_proven_in_its_bytes(tmp_path, monkeypatch, piece, rebuilt):
    root = tiny_checkpoint(tmp_path, non_expert="bf16")
    monkeypatch.setattr(reader, "_INDEX_PIECE", piece)
    if not rebuilt:
        monkeypatch.setattr(reader, "_rebuilt_index", lambda *_args: None)
    source = LocalSource(root)
    ckpt = open_checkpoint(root)
    with monkeypatch.context() as m:
        m.setattr(sources, "MAX_JSON_BYTES", (root / INDEX).stat().st_size - 1)
        total = json.loads((root / INDEX).read_text())["metadata"]["total_size"]
        proven = reader.index_of(source, reader.listing(source), ckpt.tensors, ckpt.headers)
        assert proven == (INDEX, {"total_size": total})
    large, small = both(root, monkeypatch)
    assert large == small and not large[0][4]


@pytest.mark.parametrize("edit", [
    lambda wm: wm.pop(first(wm)),  # a tensor the index leaves out
    lambda wm: wm.update({"model.layers.3.mlp.experts.0.up_proj.extra": "model-layer-003.safetensors"}),  # one it invents
    lambda wm: wm.update({first(wm): sorted(set(wm.values()))[-1]}),  # one mapped to another shard
    lambda wm: wm.update({first(wm): "missing.safetensors"}),  # a shard that does not exist
    lambda wm: wm.update({first(wm): "../outside.safetensors"}),  # a path leaving the checkpoint
])
def test_an_index_that_disagrees_is_read_in_full(tmp_path, monkeypatch, edit):
    root = tiny_checkpoint(tmp_path, non_expert="bf16")
    rewrite(root, edit)
    source = LocalSource(root)
    ckpt = open_checkpoint(root)
    with monkeypatch.context() as m:
        m.setattr(sources, "MAX_JSON_BYTES", (root / INDEX).stat().st_size - 1)
        assert reader.index_of(source, reader.listing(source), ckpt.tensors, ckpt.headers) is None
    large, small = both(root, monkeypatch)
    assert large == small


def test_a_name_in_two_shards_reads_the_same_both_ways(tmp_path, monkeypatch):
    """The index may name either copy: the first shard's (which the headers alone choose) or the other's."""
    root = tiny_checkpoint(tmp_path, non_expert="bf16")
    shards = sorted(p for p in root.glob("*.safetensors"))
    from safetensors.torch import load_file, save_file

    a, b = load_file(shards[0]), load_file(shards[-1])
    name = sorted(a)[0]
    save_file({**b, name: a[name]}, shards[-1])
    for owner in (shards[0].name, shards[-1].name):
        rewrite(root, lambda wm: wm.update({name: owner}))
        large, small = both(root, monkeypatch)
        assert large == small
