"""diff of a checkpoint against a copy read through one model (`_alike`): a layer whose units are all identical is
decided from its columns in bulk (`bulk_units`, no record per unit), and the document is the one the per-unit
path gives (two openings compared unit by unit), on every dialect of per-linear shards and on odd layers; a layer
the columns cannot describe, or with a unit that differs, goes unit by unit."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from corrupt import INDEX, SHARD3, SHARD4, key, read_header, rebuild_shard, rewrite_header
from helpers import to_plain_exl3, to_r7, to_r7_v2
from test_diff_alike import copy, overwrite
from trellis_cli.dialects.open import open_checkpoint
from trellis_cli.diff.result import DiffResult
from trellis_cli.diff.run import (_Comparer, _alike, _decided_by_files, _layer_facts, _side, _unit_facts,
                                  compared_tp, diff_sources, run_diff)
from trellis_cli.diff.units import bulk_units, layer_units
from trellis_cli.synth import preset, write_checkpoint


def _reshape(shard, name, shape):
    """Declare another shape of the same element count for one tensor (its bytes stay where they are)."""
    rewrite_header(shard, lambda h: h[name].__setitem__("shape", shape))


def _trellis_shape(root, name):
    return read_header(root / SHARD3)[1][name]["shape"]


def _mixed_k(root):
    """One linear of expert 0 at twice its K: [a, b, 16K] read as [a, b/2, 32K]."""
    name = key(3, 0, "up_proj", 1, "trellis")
    a, b, c = _trellis_shape(root, name)
    _reshape(root / SHARD3, name, [a, b // 2, 2 * c])


def _no_k(root):
    """One trellis whose last dimension is no multiple of 16, one that is 2-D: neither gives a K."""
    a, b, c = _trellis_shape(root, key(3, 1, "gate_proj", 0, "trellis"))
    _reshape(root / SHARD3, key(3, 1, "gate_proj", 0, "trellis"), [a * 16, b, c // 16])
    _reshape(root / SHARD3, key(3, 2, "down_proj", 1, "trellis"), [a * b, c])


def _drop(root, name):
    rewrite_header(root / SHARD3, lambda h: h.pop(name))


def _extra_field(root, dtype=torch.int32):
    """A `bias` under a linear's prefix: an extra field, no unit. The shard is written anew, its tensors ordered by
    dtype, then name: as I32 the bias follows the I32 markers and every expert still lists down, gate, up."""
    rebuild_shard(root, SHARD3, lambda t: t.__setitem__(key(3, 4, "gate_proj", 0, "bias"), torch.ones(8, dtype=dtype)))


def _split_layer(root):
    """Layer 3's experts 6 and 7 moved to a second file."""
    moved = {}

    def take(tensors):
        for name in [n for n in tensors if ".experts.6." in n or ".experts.7." in n]:
            moved[name] = tensors.pop(name)
    rebuild_shard(root, SHARD3, take)
    save_file(moved, str(root / "model-layer-003-b.safetensors"), metadata={"format": "pt"})
    index = json.loads((root / INDEX).read_text())
    index["weight_map"].update(dict.fromkeys(moved, "model-layer-003-b.safetensors"))
    (root / INDEX).write_text(json.dumps(index))


def _missing_rank(root):
    """A linear missing in one expert: the layer's linears are no longer laid out alike."""
    rebuild_shard(root, SHARD4, lambda t: [t.pop(k) for k in list(t) if ".experts.2.up_proj.rank1." in k])


def _missing_expert(root):
    rebuild_shard(root, SHARD3, lambda t: [t.pop(k) for k in list(t) if ".experts.5." in k])


def _tp1(tmp_path, sparse):
    """At TP 1, for a converter that rewrites its shards whole (so with every byte written, sparse or not)."""
    return write_checkpoint(tmp_path / "a", replace(preset("tiny"), tp=1))


def _tiny(tmp_path, sparse, **changes):
    return write_checkpoint(tmp_path / "a", replace(preset("tiny"), sparse=sparse, **changes))


# name -> (build the checkpoint, the layers whose units the columns describe)
SOURCES = {
    "tr3 per_expert_v1": (lambda t, s: _tiny(t, s), {3, 4}),
    "tr3 shared_h_v1": (lambda t, s: _tiny(t, s, rotation_layout="shared_h_v1"), {3, 4}),
    "plain exl3": (lambda t, s: to_plain_exl3(_tp1(t, s)), {3, 4}),
    "r7": (lambda t, s: to_r7(_tiny(t, s)), {3, 4}),
    "r7 v2 (layer-shared vectors)": (lambda t, s: to_r7_v2(_tp1(t, s)), {3, 4}),
    "a linear without its suh": (lambda t, s: _edit(_tiny(t, s), _drop, key(3, 0, "gate_proj", 1, "suh")), {3, 4}),
    "a linear without its trellis": (lambda t, s: _edit(_tiny(t, s), _drop, key(3, 6, "down_proj", 0, "trellis")),
                                     {4}),
    "trellis shapes that give no K": (lambda t, s: _edit(_tiny(t, s), _no_k), {3, 4}),
    "an expert with mixed K": (lambda t, s: _edit(_tiny(t, s), _mixed_k), {3, 4}),
    "an extra field": (lambda t, s: _edit(_tiny(t, s), _extra_field), {3, 4}),
    # as F32 the bias comes first: expert 4 lists gate first, the others down first
    "projections listed in another order": (lambda t, s: _edit(_tiny(t, s), _extra_field, torch.float32), {4}),
    "a layer over two files": (lambda t, s: _edit(_tiny(t, s), _split_layer), {3, 4}),
    "a missing expert": (lambda t, s: _edit(_tiny(t, s), _missing_expert), {3, 4}),
    "a missing linear": (lambda t, s: _edit(_tiny(t, s), _missing_rank), {3}),
}


def _edit(root, edit, *args):
    edit(root, *args)
    manifest = root / "MANIFEST.sha256"
    if manifest.exists():  # the edit changed what it records
        manifest.unlink()
    return root


def documents(a, b, layers=None):
    """diff's document through one model for both sides, and through two openings compared unit by unit."""
    assert _alike(open_checkpoint(a), b) is not None
    both = json.dumps(diff_sources(a, b, layers=layers).to_dict())
    apart = json.dumps(run_diff(open_checkpoint(a), open_checkpoint(b), layers=layers).to_dict())
    return both, apart


def decided_in_bulk(a, b):
    """The layers `run_diff` decides from their columns, a comparing a with b through one model."""
    ck_a = open_checkpoint(a)
    ck_b = _alike(ck_a, b)
    tp = compared_tp(ck_a, ck_b)
    result = DiffResult(a=_side(ck_a), b=_side(ck_b), compared_tp=tp, layers_compared=[])
    comparer = _Comparer(ck_a, ck_b, result, None, None)
    return {layer for layer in sorted(ck_a.layers) if _decided_by_files(comparer, layer, tp) is not None}


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("source", list(SOURCES))
def test_bulk_units_are_the_units(tmp_path, source, sparse):
    build, described = SOURCES[source]
    ck = open_checkpoint(build(tmp_path, sparse))
    tp = compared_tp(ck, ck)
    for layer in sorted(ck.layers):
        bulk, units = bulk_units(ck, layer, tp), layer_units(ck, layer, tp)
        assert (bulk is not None) == (layer in described), layer
        if bulk is None:
            continue
        assert bulk.total == len(units) == sum(len(begins) for begins, _ in bulk.spans.values())
        spans = {file: sorted(zip(begins.tolist(), ends.tolist())) for file, (begins, ends) in bulk.spans.items()}
        by_unit: dict[str, list] = {}
        for unit in units.values():
            by_unit.setdefault(unit.span.file, []).append((unit.span.begin, unit.span.end))
        assert spans == {file: sorted(pairs) for file, pairs in by_unit.items()}
        assert _layer_facts(bulk.expert_ks, bulk.bits, bulk.weights, bulk.rank_bytes) == _unit_facts(units)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_copy_is_decided_in_bulk_with_the_per_unit_answer(tmp_path, source, sparse):
    build, described = SOURCES[source]
    a = build(tmp_path, sparse)
    b = copy(a, tmp_path / "b")
    assert decided_in_bulk(a, b) == described
    both, apart = documents(a, b)
    assert both == apart
    doc = json.loads(both)
    assert doc["identical"] and doc["methods"] == {"sha256": doc["counts"]["identical"]}
    assert [layer["layer"] for layer in doc["layers"]] == [3, 4]
    for layers in ([4], [3]):  # --layers: a subset, the non-expert tensors left out
        both, apart = documents(a, b, layers)
        assert both == apart and json.loads(both)["layers_compared"] == layers


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("source", ["tr3 per_expert_v1", "tr3 shared_h_v1", "plain exl3",
                                    "r7 v2 (layer-shared vectors)", "a layer over two files"])
def test_a_changed_shard_goes_unit_by_unit_the_others_in_bulk(tmp_path, source, sparse):
    a = SOURCES[source][0](tmp_path, sparse)
    b = copy(a, tmp_path / "b")
    changed = next(name for name in json.loads((a / INDEX).read_text())["weight_map"]
                   if name.startswith("model.layers.4.") and name.endswith(".trellis"))
    overwrite(b, changed)
    assert decided_in_bulk(a, b) == {3}
    both, apart = documents(a, b)
    assert both == apart
    # every unit's bytes reported once, read or in holes: layer 4's hashes taken in bulk are not taken again
    # (where one shared-H row stands for several units, holes report it per unit, a hash once per span)
    reported: list[list[int]] = [[], []]
    diff_sources(a, b, progress=reported[0].append)
    run_diff(open_checkpoint(a), open_checkpoint(b), progress=reported[1].append)
    assert sum(reported[0]) == sum(reported[1]) > 0 or (sparse and "shared_h" in source)
    doc = json.loads(both)
    (difference,) = doc["differences"]
    assert (difference["layer"], difference["status"], difference["part"]) == (4, "bytes", "codes")


def test_files_the_same_by_storage_and_files_hashed_share_one_layer(tmp_path):
    """Layer 3 over two files, one of them the same file on both sides (a hard link), the other a copy."""
    a = _edit(_tiny(tmp_path, True), _split_layer)
    b = copy(a, tmp_path / "b")
    os.unlink(b / "model-layer-003-b.safetensors")
    os.link(a / "model-layer-003-b.safetensors", b / "model-layer-003-b.safetensors")
    assert decided_in_bulk(a, b) == {3, 4}
    both, apart = documents(a, b)
    assert both == apart
    layer3 = json.loads(both)["layers"][0]
    assert set(layer3["methods"]) == {"same-file", "sha256"}


def test_the_same_directory_is_decided_in_bulk_by_storage(tmp_path):
    a = _tiny(tmp_path, False)
    assert decided_in_bulk(a, a) == {3, 4}
    both, apart = documents(a, a)
    assert both == apart and json.loads(both)["methods"] == {"same-file": json.loads(both)["counts"]["identical"]}
