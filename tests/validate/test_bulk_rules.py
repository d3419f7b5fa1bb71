"""The rules' bulk proofs against their per-item walks, on damaged checkpoints.

validate proves a clean layer's linears and markers, and inspect sums its layer rows, with a few C passes over the
layer's columns (checkpoint/layer_columns.py), walking one item at a time only where the proof fails. The proofs must never
change a finding: for every damage of the robustness corpus, and for damages aimed at what each proof reads
(a field's dtype or shape in one linear, an extra field, a rank or projection missing, markers of two kinds or
in two files, a K that differs within an expert), each rule gives the same findings with and without its proof,
inspect the same layer rows and totals, and the layer facts from the columns equal the model's own.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from corrupt import CORPUS, INDEX, SHARD3, SHARD4, edit_json, key, rebuild_shard, rewrite_header
from trellis_cli.checkpoint import layer_columns
from trellis_cli.dialects import inspect_doc, open_checkpoint
from trellis_cli.errors import CheckFailed, UnknownDialect
from trellis_cli.synth import preset, write_checkpoint
from trellis_cli.validate import rules_markers, rules_tensors


def suh_as_f32(root: Path) -> None:
    rewrite_header(root / SHARD3, lambda h: h[key(3, 2, "gate_proj", 1, "suh")].update(dtype="F32"))


def svh_shape(root: Path) -> None:
    rewrite_header(root / SHARD4, lambda h: h[key(4, 6, "down_proj", 0, "svh")].update(shape=[1, 1]))


def marker_as_f32(root: Path) -> None:
    rewrite_header(root / SHARD3, lambda h: h[key(3, 1, "up_proj", 0, "mcg")].update(dtype="F32"))


def marker_shape(root: Path) -> None:
    rewrite_header(root / SHARD4, lambda h: h[key(4, 0, "gate_proj", 1, "mcg")].update(shape=[1]))


def extra_bias(root: Path) -> None:
    rebuild_shard(root, SHARD3, lambda t: t.update({key(3, 4, "up_proj", 1, "bias"): torch.zeros(4)}))


def missing_projection(root: Path) -> None:
    rebuild_shard(root, SHARD3, lambda t: [t.pop(k) for k in list(t) if ".experts.3.down_proj." in k])


def extra_rank(root: Path) -> None:
    def mutate(t: dict) -> None:
        for k in [k for k in t if ".experts.1.gate_proj.rank1." in k]:
            t[k.replace(".rank1.", ".rank2.")] = t[k].clone()

    rebuild_shard(root, SHARD4, mutate)


def one_rank_other_k(root: Path) -> None:
    def mutate(t: dict) -> None:
        name = key(3, 5, "up_proj", 0, "trellis")
        t[name] = torch.zeros(*t[name].shape[:2], t[name].shape[2] + 16, dtype=t[name].dtype)

    rebuild_shard(root, SHARD3, mutate)


def mul1_markers_in_one_layer(root: Path) -> None:
    def mutate(t: dict) -> None:
        for k in [k for k in t if k.endswith(".mcg")]:
            t[k.removesuffix(".mcg") + ".mul1"] = torch.tensor(-2082680531, dtype=torch.int32)
            del t[k]

    rebuild_shard(root, SHARD4, mutate)


def markers_of_both_kinds(root: Path) -> None:
    def mutate(t: dict) -> None:
        for k in [k for k in t if k.endswith(".mcg") and ".experts.2." in k]:
            t[k.removesuffix(".mcg") + ".mul1"] = torch.tensor(-2082680531, dtype=torch.int32)
            del t[k]

    rebuild_shard(root, SHARD3, mutate)


def markers_in_two_files(root: Path) -> None:
    """Expert 7's markers of layer 3 moved to a shard of their own (the index follows them)."""
    tensors = load_file(str(root / SHARD3))
    moved = {k: tensors.pop(k) for k in list(tensors) if ".experts.7." in k and k.endswith(".mcg")}
    save_file(tensors, str(root / SHARD3), metadata={"format": "pt"})
    save_file(moved, str(root / "model-markers.safetensors"), metadata={"format": "pt"})
    edit_json(root / INDEX, lambda index: index["weight_map"].update(dict.fromkeys(moved, "model-markers.safetensors")))


def wrong_marker_values(root: Path) -> None:
    """Several wrong values in both layers, so the findings' order is compared too."""
    import struct

    from corrupt import write_tensor_bytes

    for layer, shard, expert, proj, rank in ((4, SHARD4, 7, "gate_proj", 1), (3, SHARD3, 0, "down_proj", 0),
                                             (3, SHARD3, 6, "up_proj", 1), (4, SHARD4, 1, "up_proj", 0)):
        write_tensor_bytes(root / shard, key(layer, expert, proj, rank, "mcg"), struct.pack("<i", 7 + expert))


AIMED: dict[str, Callable[[Path], None]] = {
    "suh-as-f32": suh_as_f32, "svh-shape": svh_shape, "marker-as-f32": marker_as_f32, "marker-shape": marker_shape,
    "extra-bias": extra_bias, "missing-projection": missing_projection, "extra-rank": extra_rank,
    "one-rank-other-k": one_rank_other_k, "mul1-markers-in-one-layer": mul1_markers_in_one_layer,
    "markers-of-both-kinds": markers_of_both_kinds, "markers-in-two-files": markers_in_two_files,
    "wrong-marker-values": wrong_marker_values,
}
CASES = {**{f"corpus-{name}": corrupt for name, (corrupt, _) in CORPUS.items()}, **AIMED}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bulk") / "tiny", preset("tiny"))


def _findings_both_ways(ckpt) -> None:
    layers = list(ckpt.layers)
    for layer in ckpt.layers.values():
        walked = list(rules_tensors.check_layer(ckpt, layer, bulk=False))
        assert list(rules_tensors.check_layer(ckpt, layer)) == walked, layer.index
        cols = layer_columns.columns(layer)
        assert cols.partition() == layer.partition()
        assert {e: cols.expert_k(e) for e in layer.experts} == {e: layer.expert_k(e) for e in layer.experts}
        assert cols.linears == [lin for projs in layer.experts.values() for by_rank in projs.values()
                                for lin in by_rank.values()]
        assert cols.expert_ks() == {e: frozenset(lin.k for by_rank in projs.values() for lin in by_rank.values())
                                    for e, projs in layer.experts.items()}
        assert inspect_doc.layer_summary(ckpt, layer) == inspect_doc.layer_summary(ckpt, layer, bulk=False)
        assert rules_tensors.layer_tensor_count(layer) == sum(
            len(f) for f in layer.shared_h.values()) + len(layer.r7_shared) + len(layer.unparsed) + sum(
            7 - lin[:7].count(None) + len(lin.extra) for lin in cols.linears)
    assert inspect_doc._expert_tensor_bytes(ckpt) == sum(
        ref.nbytes for layer in ckpt.layers.values() for lin in layer_columns.columns(layer).linears
        for ref in [*lin[:7], *lin.extra] if ref is not None) + sum(
        ref.nbytes for layer in ckpt.layers.values() for refs in (
            [r for f in layer.shared_h.values() for r in f.values()], layer.r7_shared.values(), layer.unparsed)
        for ref in refs)
    counted: list[dict[str, int]] = [{}, {}]
    for bulk, seen in ((True, counted[0]), (False, counted[1])):
        found = list(rules_markers.check_marker_values(
            ckpt, layers, lambda what, n, seen=seen: seen.__setitem__(what, seen.get(what, 0) + n), bulk=bulk))
        if bulk:
            with_bulk = found
        else:
            assert with_bulk == found
    assert counted[0] == counted[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bulk_proofs_find_what_the_walks_find(case, pristine, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    CASES[case](root)
    try:
        ckpt = open_checkpoint(root)
    except (CheckFailed, UnknownDialect):
        return  # not opened: no rule runs
    _findings_both_ways(ckpt)
    with layer_columns.shared():  # as validate runs them: each layer's columns built once
        _findings_both_ways(ckpt)
    for layer in ckpt.layers.values():  # the tensors a layer's linears hold, counted in one pass and walked
        cols = layer_columns.columns(layer)
        walked = sum(sum(ref is not None for ref in lin[:7]) + len(lin.extra) for lin in cols.linears)
        assert cols.tensors_held() == walked == sum(map(cols.present, layer_columns.TENSOR_FIELDS)) + \
            sum(map(len, cols.field(layer_columns.EXTRA))), (case, layer.index)


def test_a_clean_layer_is_proven_in_bulk(pristine):
    """The proofs hold on a clean checkpoint (else validate walks every linear again, correct but slow)."""
    ckpt = open_checkpoint(pristine)
    for layer in ckpt.layers.values():
        ctx = rules_tensors._context(ckpt, layer)
        assert rules_tensors._linears_clean(ctx, layer_columns.columns(layer), range(ctx.tp)), layer.index
        assert rules_markers._marker_column(ckpt, layer.index) is not None


def test_shared_columns_hold_the_fields_of_one_layer(pristine):
    """Within `shared()` a layer's facts are built once, its field columns only while it is the layer read: reading
    another drops them, and reading it again builds the same columns."""
    ckpt = open_checkpoint(pristine)
    first, second = list(ckpt.layers.values())[:2]
    with layer_columns.shared():
        cols = layer_columns.columns(first)
        trellis, partition = cols.field(layer_columns.TRELLIS), cols.partition()
        assert layer_columns.columns(second).field(layer_columns.TRELLIS)
        assert not cols._fields and layer_columns.columns(first) is cols  # dropped; the facts kept
        assert cols.partition() is partition and cols.field(layer_columns.TRELLIS) == trellis
        assert cols.field(layer_columns.TRELLIS) == layer_columns.LayerColumns(first).field(layer_columns.TRELLIS)
