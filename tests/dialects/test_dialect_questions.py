"""What diff, fit and inspect ask a dialect about its bytes: the `Dialect` defaults answer for per-linear shards,
so a dialect that overrides none of them (a new shard dialect) gets the same answers as TR3, whose package
overrides none of them either; and the exl3-v1 answers are what the commands read."""

from __future__ import annotations

import dataclasses

import pytest

from trellis_cli.dialects import open_checkpoint
from trellis_cli.dialects.interface import Dialect
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.errors import CheckFailed
from trellis_cli.sample import sample_path


class Bare(Dialect):
    """A dialect that writes nothing but its name: every question falls to the defaults."""

    name = "bare"


def test_a_dialect_that_overrides_nothing_answers_as_the_shards(tmp_path):
    from trellis_cli.synth import preset, write_checkpoint

    spec = dataclasses.replace(preset("tiny"), seed=7)  # random codes and vectors, never zeros
    ck = open_checkpoint(write_checkpoint(tmp_path / "tr3", spec))
    tr3, bare = dialect_of(ck), Bare()
    assert bare.stored_tp(ck) == tr3.stored_tp(ck) == ck.tp and bare.read_tp(ck) == ck.tp
    assert bare.compared_layers(ck) == tr3.compared_layers(ck) == [3, 4]
    units = bare.layer_units(ck, 3, ck.tp)
    assert units == tr3.layer_units(ck, 3, ck.tp) and len(units) == spec.experts * 3 * ck.tp * 3
    assert all(u.span is not None for u in units.values())  # at the stored TP: where the bytes lie
    for dialect in (bare, tr3):  # another TP: re-sliced in memory, where exact (these slices were not)
        with pytest.raises(CheckFailed, match="merging them is not exact"):
            dialect.layer_units(ck, 3, 1)
    assert bare.other_units(ck) == tr3.other_units(ck)  # synth writes experts only
    assert bare.layer_file_tensors(ck, 3) is None and bare.stored_expert_k(ck, 3) is None
    assert bare.model_facts(ck) == {} and set(bare.declaration_documents(ck)) == {"config.json"}
    assert bare.layer_files(ck) == {} and bare.loose_tensors(ck) is None and bare.codes_tables(ck) == {}
    assert bare.weights_refusal(ck) is None and bare.layer_shares(ck, ck.tp, 99) is None
    assert bare.source_digests(ck) == {} and bare.rank_sliced_contract(ck) is None
    assert bare.bit_map_problems(ck) == [] and bare.slot_manifest(ck) is None
    assert bare.declarations(ck, None, ck.source.read_json, ck.files) is None  # type: ignore[arg-type]
    assert bare.inspect_document(ck, None) == tr3.inspect_document(ck, None)
    assert tr3.rank_sliced_contract(ck)["tp"] == ck.tp


def test_exl3v1_answers_for_its_layer_files(exl3):
    ck = open_checkpoint(exl3)
    dialect = dialect_of(ck)
    files = dialect.layer_files(ck)
    assert sorted(files.values()) == sorted(ck.layers) and all(name in ck.files for name in files)
    assert dialect.stored_tp(ck) is None and dialect.model_facts(ck) == {"tp": None}
    manifest, manifest_file = dialect.slot_manifest(ck)
    assert manifest_file in dialect.declaration_documents(ck)
    assert set(dialect.codes_tables(ck)) == set(files)
    layer = sorted(ck.layers)[0]
    assert {key[1] for key in dialect.layer_file_tensors(ck, layer)} == set(ck.headers[_file_of(files, layer)].tensors)
    ks = dialect.stored_expert_k(ck, layer)
    assert ks is not None and len(ks) == manifest.num_experts
    tp = dialect.read_tp(ck)
    shares = dialect.layer_shares(ck, tp, rates_below=max(ck.layers) + 1)
    assert [s.layer for s in shares] == sorted(ck.layers)
    for share in shares:
        assert len(share.ranks) == tp  # each rank its extent of slots, and the whole hidden-side tables
        assert all(0 < r.nbytes < share.nbytes for r in share.ranks)
        assert all(r.experts is not None and len(r.experts) == manifest.num_experts for r in share.ranks)
        assert all(sum(b for _, b in r.experts or ()) <= r.nbytes for r in share.ranks)


def _file_of(files: dict[str, int], layer: int) -> str:
    return next(name for name, index in files.items() if index == layer)


def test_exl3v1_source_digests_are_the_ones_repack_checks(exl3):
    """The source-hash plan asked of the dialect equals what repack's source facts read from the manifest."""
    from trellis_cli.dialects.source_facts import recorded_hashes

    ck = open_checkpoint(exl3)
    from_manifest = {name: [entry for entry in found if entry[2] == "exl3v1.sha256-mismatch"]
                     for name, found in recorded_hashes(ck).items()}
    assert dialect_of(ck).source_digests(ck) == {name: found for name, found in from_manifest.items() if found}
    assert dialect_of(ck).source_digests(ck)  # the synthetic container records real digests


def test_the_bundled_sample_is_answered_by_the_defaults():
    ck = open_checkpoint(sample_path())
    dialect = dialect_of(ck)
    assert dialect.layer_files(ck) == {} and dialect.loose_tensors(ck) is None
    assert dialect.weights_refusal(ck) is None
    assert Bare().other_units(ck) == dialect.other_units(ck)
    assert Bare().inspect_document(ck, None) == dialect.inspect_document(ck, None)
