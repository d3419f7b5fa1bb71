"""Hostile input to the conversions (issue 42, classes 1, 3, 10): a name read from a checkpoint never becomes a
path outside OUT, corrupt source bytes are never converted and re-hashed as good, and a config note of the
wrong types is a named refusal. Every refusal leaves everything outside OUT, and the source, byte-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import exl3v1_from_tr3, flip_tensor_byte, run_cli_merged, tree_snapshot
from trellis_cli.dialects.conversion import output_name
from trellis_cli.errors import CheckFailed

NOTE = "trellis_exl3v1"
TARGETS = ("tr3", "route-pack")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return exl3v1_from_tr3(tmp_path_factory.mktemp("conv"))


@pytest.fixture
def work(converted, tmp_path) -> Path:
    """A fresh copy of the converted checkpoint (exl3/) and its TR3 source (tr3/) under tmp_path/work."""
    root = tmp_path / "work"
    shutil.copytree(converted.parent, root)
    return root


def edit_note(exl3: Path, edit) -> None:
    config = json.loads((exl3 / "config.json").read_text())
    edit(config)
    (exl3 / "config.json").write_text(json.dumps(config))


def refused_and_untouched(capsys, tmp_path: Path, source: Path, out: Path, *args: str) -> str:
    """Run `repack SOURCE OUT ARGS`: exit 1, no OUT, no OUT.partial, and tmp_path (the source in it) unchanged."""
    before = tree_snapshot(tmp_path)
    code, text = run_cli_merged(capsys, "repack", str(source), str(out), *args)
    assert code == 1, text
    assert "internal error" not in text and "Traceback" not in text
    assert not out.exists() and not Path(f"{out}.partial").exists()
    assert tree_snapshot(tmp_path) == before
    return text


# ---- class 1: names from the checkpoint never leave OUT ------------------------------------------------

@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("name", ["{victim}", "../x.safetensors", "sub/../../x.safetensors", "a\\b.safetensors",
                                  "./model-layer-003.safetensors", "sub//x.safetensors", "", "/", "sub/",
                                  "x.safetensors\n", "C:x.safetensors", "model-layer-003.json"])
def test_a_shard_name_from_the_note_that_is_not_a_plain_name_is_refused(capsys, work, tmp_path, to, name):
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"not to be overwritten")
    name = name.format(victim=victim)
    edit_note(work / "exl3", lambda c: c[NOTE]["shard_names"].update({"3": name}))
    text = refused_and_untouched(capsys, tmp_path, work / "exl3", tmp_path / "out", "--to", to)
    assert "[exl3v1.note]" in text and "shard_names['3']" in text
    assert victim.read_bytes() == b"not to be overwritten"


def test_a_nested_shard_name_stays_under_out(capsys, work, tmp_path):
    edit_note(work / "exl3", lambda c: c[NOTE]["shard_names"].update({"3": "sub/model-layer-003.safetensors"}))
    code, text = run_cli_merged(capsys, "repack", str(work / "exl3"), str(tmp_path / "out"), "--to", "tr3")
    assert code == 0, text
    assert (tmp_path / "out" / "sub" / "model-layer-003.safetensors").is_file()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "sub/model-layer-003.safetensors" in index["weight_map"].values()


@pytest.mark.parametrize("name", ["{victim}", "../x.safetensors", "./x.safetensors", "a//x.safetensors",
                                  "a/./x.safetensors"])
def test_a_tr3_shard_name_from_a_route_pack_manifest_stays_under_out(capsys, work, tmp_path, name):
    from helpers import edited_pack
    from trellis_cli import RepackOptions, run_repack

    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"not to be overwritten")
    run_repack(str(work / "exl3"), work / "pack0", RepackOptions())
    pack = edited_pack(work / "pack0", work / "pack",
                       lambda doc: doc["layers"]["3"].update({"tr3_shard": name.format(victim=victim)}))
    text = refused_and_untouched(capsys, tmp_path, pack, tmp_path / "out", "--to", "tr3")
    assert "path.escape" in text
    assert victim.read_bytes() == b"not to be overwritten"


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../b", "a//b", "a/./b", "./a", "a/", "", ".", "a\\b",
                                  "C:a", "a\0b", "a\nb", "a\x7fb", 3, None, ["a"]])
def test_every_output_name_is_checked_by_one_helper(name):
    with pytest.raises(CheckFailed) as e:
        output_name(name, "the test output")
    assert e.value.code == "path.escape" and "the test output" in str(e.value)


def test_plain_output_names_pass():
    for name in ("config.json", "extra/model-00001.safetensors", "a b/c.json", "über.json", "..x", "x.."):
        assert output_name(name, "x") == name


# ---- class 10: the note's types are named refusals, never internal errors ------------------------------

@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("key,value,where", [
    ("shard_names", {"3": 3}, "shard_names['3']"),
    ("shard_names", {"3": None}, "shard_names['3']"),
    ("shard_names", ["model-layer-003.safetensors"], "shard_names"),
    ("shard_names", "model-layer-003.safetensors", "shard_names"),
    ("vector_ndim", "abc", "vector_ndim"),
    ("vector_ndim", {"per_expert": "2", "shared_h": 1}, "vector_ndim.per_expert"),
    ("vector_ndim", {"per_expert": 1, "shared_h": 3}, "vector_ndim.shared_h"),
    ("vector_ndim", {"per_expert": True, "shared_h": 1}, "vector_ndim.per_expert"),
    ("tp", "1", ".tp"),
    ("tp", [1], ".tp"),
    ("tp", True, ".tp"),
])
def test_a_note_of_the_wrong_type_is_a_named_refusal(capsys, work, tmp_path, to, key, value, where):
    edit_note(work / "exl3", lambda c: c[NOTE].update({key: value}))
    text = refused_and_untouched(capsys, tmp_path, work / "exl3", tmp_path / "out", "--to", to)
    assert "[exl3v1.note]" in text and where in text and "expected" in text and "found" in text


@pytest.mark.parametrize("note", [[], "x", 3])
def test_a_note_that_is_not_an_object_is_a_named_refusal(capsys, work, tmp_path, note):
    edit_note(work / "exl3", lambda c: c.update({NOTE: note}))
    text = refused_and_untouched(capsys, tmp_path, work / "exl3", tmp_path / "out", "--to", "tr3")
    assert "[exl3v1.note]" in text and "an object" in text


# ---- class 3: corrupt source bytes are refused, not converted ------------------------------------------

@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("tensor", ["codes", "rotations", "gate_suh"])
def test_a_flipped_byte_in_an_exl3v1_layer_is_refused(capsys, work, tmp_path, to, tensor):
    layer = work / "exl3" / "exl3-layer-00004.safetensors"
    flip_tensor_byte(layer, tensor, at=7)
    manifest = json.loads((work / "exl3" / "exl3-manifest.json").read_text())
    text = refused_and_untouched(capsys, tmp_path, work / "exl3", tmp_path / "out", "--to", to)
    assert "[exl3v1.sha256-mismatch]" in text and "exl3-layer-00004.safetensors" in text
    assert manifest["layers"]["4"]["sha256"] in text  # expected ...
    import hashlib
    assert hashlib.sha256(layer.read_bytes()).hexdigest() in text  # ... and found


@pytest.mark.parametrize("args", [("--to", "tr3", "--tp", "2"), ("--to", "route-pack"), ("--to", "exl3-v1")])
def test_a_tr3_shard_that_differs_from_manifest_sha256_is_refused(capsys, work, tmp_path, args):
    flip_tensor_byte(work / "tr3" / "model-layer-004.safetensors",
                     "model.layers.4.mlp.experts.0.down_proj.rank0.trellis", at=3)
    text = refused_and_untouched(capsys, tmp_path, work / "tr3", tmp_path / "out", *args)
    assert "[checksum.mismatch]" in text and "model-layer-004.safetensors" in text and "MANIFEST.sha256" in text


def test_a_corrupt_file_carried_through_is_refused(capsys, work, tmp_path):
    bitmap = work / "tr3" / "tier_bitmap.json"
    bitmap.write_bytes(bitmap.read_bytes() + b" ")  # valid JSON, not what MANIFEST.sha256 records
    text = refused_and_untouched(capsys, tmp_path, work / "tr3", tmp_path / "out", "--to", "exl3-v1")
    assert "[checksum.mismatch]" in text and "tier_bitmap.json" in text


def test_a_good_source_still_converts_both_ways(capsys, work, tmp_path):
    source = tree_snapshot(work)
    for to in TARGETS:
        code, text = run_cli_merged(capsys, "repack", str(work / "exl3"), str(tmp_path / to), "--to", to)
        assert code == 0, text
    assert tree_snapshot(work) == source


# ---- class 7: what TR3 cannot declare is refused before writing ----------------------------------------

K2_SPECS = {
    "uniform-k2": dict(hidden=256, intermediate=512, experts=4, tp=1, layers=(3,), uniform_k=2, top_k=2,
                       rotation_layout="shared_h_v1"),
    "mixed-k2": dict(hidden=256, intermediate=1024, experts=6, tp=1, layers=(3,), bitmap={3: (2, 3, 4, 2, 3, 4)},
                     top_k=2),
}


@pytest.mark.parametrize("spec", list(K2_SPECS))
def test_mcg_k2_to_tr3_is_refused_before_writing(capsys, tmp_path, spec):
    from trellis_cli import RepackOptions, run_repack
    from trellis_cli.errors import UsageError
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
    from trellis_cli.synth import SynthSpec

    source = write_exl3v1_checkpoint(tmp_path / "exl3", SynthSpec(**K2_SPECS[spec]))
    before = tree_snapshot(tmp_path)
    code, text = run_cli_merged(capsys, "repack", str(source), str(tmp_path / "out"), "--to", "tr3")
    assert code in (1, 2) and "K2" in text, text  # refused by the conversion (or by a source check before it)
    assert tree_snapshot(tmp_path) == before
    with pytest.raises(UsageError, match="layer 3 expert 0 is K2.*refusing before any work"):
        run_repack(str(source), tmp_path / "out", RepackOptions(to="tr3", validate=False))
    assert tree_snapshot(tmp_path) == before
    # The same K through a route pack: the pack holds it, the way back to TR3 refuses it the same way.
    run_repack(str(source), tmp_path / "pack", RepackOptions(validate=False))
    code, text = run_cli_merged(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "out"), "--to", "tr3")
    assert code == 2 and "is K2" in text and "refusing before any work" in text, text
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("key,value,code", [("bits", "x", "config.tr3-bits"),
                                            ("trellis_bits_by_layer", [], "engine.bits-map")])
def test_a_tr3_output_its_validator_refuses_is_never_written(capsys, work, tmp_path, key, value, code):
    """The TR3 config carried from an exl3-v1 source holds what TR3 cannot declare: the staged output is
    validated as a format (not by engine profile) before it is moved into place."""
    edit_note(work / "exl3", lambda c: c["hybrid_tr3_tail"].update({key: value}))
    text = refused_and_untouched(capsys, tmp_path, work / "exl3", tmp_path / "out", "--to", "tr3")
    assert "the TR3 output would not validate" in text and f"[{code}]" in text


def test_repack_and_validate_agree_on_the_k_tr3_declares():
    from trellis_cli.dialects.tr3.declared import TR3_MIXED_K, TR3_UNIFORM_K
    from trellis_cli.dialects.tr3.rules import MIXED_K_RANGE, UNIFORM_K_VALUES

    assert set(TR3_UNIFORM_K) == set(UNIFORM_K_VALUES) and set(TR3_MIXED_K) == set(MIXED_K_RANGE)


def test_validate_names_a_bad_note_as_a_warning(capsys, work):
    """b12x never reads config.json, so the verdict stands; the finding says a conversion will refuse it."""
    edit_note(work / "exl3", lambda c: c[NOTE].update({"shard_names": {"3": 3}, "vector_ndim": "abc"}))
    code, text = run_cli_merged(capsys, "validate", str(work / "exl3"))
    assert code == 0, text
    assert text.count("exl3v1.note") == 2 and "shard_names['3']" in text and "vector_ndim" in text
    assert "internal error" not in text


# ---- class 2: nothing is created or changed in the source, not even the lock file -----------------------

@pytest.mark.parametrize("to", ["tr3", "route-pack"])
def test_out_inside_the_source_is_refused_before_the_lock_file_is_made(work, tmp_path, to):
    """Through the library (the CLI refuses a local OUT inside SOURCE even earlier): OUT.partial.lock would be a
    source file here, and taking the lock truncates it."""
    from trellis_cli import RepackOptions, run_repack
    from trellis_cli.errors import UsageError

    (work / "exl3" / "o.partial.lock").write_bytes(b"a source file that happens to have this name")
    before = tree_snapshot(tmp_path)
    with pytest.raises(UsageError, match="refusing"):
        run_repack(str(work / "exl3"), work / "exl3" / "o", RepackOptions(to=to))
    assert tree_snapshot(tmp_path) == before
