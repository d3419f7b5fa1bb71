"""Hostile or broken input to repack, and to validate / inspect of a route pack: a named error, never a
traceback, a hang, a write outside OUT or a read outside the pack."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import Interrupted, edited_pack, interrupt_after, run_cli_merged
from trellis_cli import synth
from trellis_cli.dialects.routepack.manifest import write_manifest


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("robust") / "src", synth.preset("tiny"))


@pytest.fixture(scope="module")
def pack(source) -> Path:
    from trellis_cli import run_repack

    return run_repack(source, source.parent / "pack").out


def assert_refused_everywhere(capsys, root: Path, out: Path, code: str, key: str) -> None:
    """validate names the finding, inspect and `repack --to tr3` refuse; nothing is written anywhere."""
    status, text = run_cli_merged(capsys, "validate", str(root))
    assert status == 1 and code in text and key in text and "Traceback" not in text, text
    status, text = run_cli_merged(capsys, "inspect", str(root))
    assert status == 1 and key in text and "Traceback" not in text, text
    status, text = run_cli_merged(capsys, "repack", str(root), str(out), "--to", "tr3")
    assert status == 1 and key in text and "Traceback" not in text, text
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def _set_source_files(names):
    return lambda doc: doc["layers"]["3"].__setitem__("source_files", names)


def _add_file(name, **entry):
    return lambda doc: doc["files"].__setitem__(name, {"sha256": "0" * 64, "size": 1, **entry})


@pytest.mark.parametrize("edit, key", [
    (_set_source_files(["ABSOLUTE"]), "source_files[0]"),
    (_set_source_files(["../victim.safetensors"]), "source_files[0]"),
    (_set_source_files(["a\\..\\..\\victim.safetensors"]), "source_files[0]"),
    (_set_source_files(["victim\0.safetensors"]), "source_files[0]"),
    (_add_file("../../../../etc/passwd", role="copied"), "../../../../etc/passwd"),
    (_add_file("extra/x.safetensors", role="extra", source_file="../victim.safetensors"), "source_file"),
], ids=["absolute", "dotdot", "backslash", "nul", "files-key", "extra-source-file"])
def test_manifest_names_outside_the_pack_are_refused_before_writing(capsys, pack, tmp_path, edit, key):
    victim = tmp_path / "PWNED.safetensors"

    def resolved(doc):  # the absolute case points at a real path next to OUT
        edit(doc)
        files = doc["layers"]["3"]["source_files"]
        doc["layers"]["3"]["source_files"] = [str(victim) if n == "ABSOLUTE" else n for n in files]

    root = edited_pack(pack, tmp_path / "p", resolved)
    assert_refused_everywhere(capsys, root, tmp_path / "out", "path.escape", key)
    assert not victim.exists() and not (tmp_path / "victim.safetensors").exists()


def test_a_listed_file_linking_out_of_the_pack_is_not_read(capsys, pack, tmp_path):
    root = tmp_path / "p"
    shutil.copytree(pack, root)
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    (root / "tier_bitmap.json").unlink()
    os.symlink(outside, root / "tier_bitmap.json")
    status, text = run_cli_merged(capsys, "validate", str(root))
    assert status == 1 and "path.escape" in text and "tier_bitmap.json" in text
    assert "hash-mismatch" not in text  # refused before hashing what the link points at


def _set(path: tuple, value):
    def edit(doc):
        node = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return edit


def _delete(path: tuple):
    def edit(doc):
        node = doc
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]
    return edit


@pytest.mark.parametrize("edit, key", [
    (lambda doc: doc["layers"].__setitem__("abc", doc["layers"]["3"]), "layers['abc']"),
    (lambda doc: doc["layers"].__setitem__("9" * 5000, doc["layers"]["3"]), "layers['99999"),
    (_set(("files", "x"), 5), "files['x']"),
    (_set(("layers", "3", "tiers", 0), 7), "layers['3'].tiers[0]"),
    (_set(("source",), []), "source"),
    (_delete(("layers", "3", "tiers", 0, "size")), "layers['3'].tiers[0].size"),
    (_set(("layers", "3", "tiers", 0, "experts"), "0-99999999999"), "layers['3'].tiers[0].experts"),
    (_set(("layers", "3", "tiers", 0, "experts"), "0-3"), "layers['3'].tiers[0].experts"),
    (_set(("layers", "3", "tiers", 0, "k"), True), "layers['3'].tiers[0].k"),
    (_set(("ranks",), [0, 99999999999]), "ranks"),
    (_set(("tp",), "2"), "tp"),
    (_set(("geometry", "num_experts"), None), "geometry.num_experts"),
    (_set(("codebook",), "nope"), "codebook"),
    (_set(("source", "vector_ndim"), 5), "source.vector_ndim"),
    (_set(("files", "config.json", "size"), "1"), "files['config.json'].size"),
    (lambda doc: doc["layers"]["3"]["tiers"].reverse(), "layers['3'].tiers[*].k"),
    (lambda doc: doc["layers"]["3"].__setitem__("tiers", doc["layers"]["3"]["tiers"][:1] * 20000),
     "at most 8 tiers"),
], ids=["layer-key", "huge-layer-key", "file-entry", "tier", "source", "tier-size", "huge-experts",
        "experts-count", "bool-k", "ranks", "tp", "num-experts", "codebook", "vector-ndim", "file-size",
        "descending-k", "too-many-tiers"])
def test_malformed_manifest_is_a_named_finding(capsys, pack, tmp_path, edit, key):
    root = edited_pack(pack, tmp_path / "p", edit)
    assert_refused_everywhere(capsys, root, tmp_path / "out", "repack.manifest-field", key)


def test_overlapping_tensor_offsets_in_a_layer_file_are_a_finding(capsys, pack, tmp_path):
    """Same file size, but tier_k's header entry points at tier_size's bytes: safetensors refuses to open it."""
    import struct

    from trellis_cli.dialects.routepack.manifest import file_entry

    root = tmp_path / "p"
    shutil.copytree(pack, root)
    layer_file = root / "layer-003-rank-0.safetensors"
    raw = layer_file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["tier_k"]["data_offsets"] = header["tier_size"]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    layer_file.write_bytes(raw[:8] + text.ljust(n, b" ") + raw[8 + n:])  # padded: the header length is unchanged
    doc = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    doc["files"][layer_file.name] = file_entry(layer_file, layer=3, rank=0)
    write_manifest(root, doc)
    status, text = run_cli_merged(capsys, "validate", str(root))
    assert status == 1 and "file.overlap" in text and layer_file.name in text and "Traceback" not in text, text
    status, text = run_cli_merged(capsys, "repack", str(root), str(tmp_path / "out"), "--to", "tr3")
    assert status == 1 and "file." in text and layer_file.name in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()


def test_a_source_at_or_inside_the_staging_directory_is_never_deleted(capsys, source, tmp_path):
    at_stage = tmp_path / "ck.partial"
    shutil.copytree(source, at_stage)
    inside_stage = tmp_path / "ck2.partial" / "src"
    shutil.copytree(source, inside_stage)
    for src, out in ((at_stage, tmp_path / "ck"), (inside_stage, tmp_path / "ck2")):
        before = sorted(p.name for p in src.iterdir())
        status, text = run_cli_merged(capsys, "repack", str(src), str(out), "--overwrite")
        assert status == 2 and f"{out}.partial" in text and str(src) in text and "Traceback" not in text, text
        assert sorted(p.name for p in src.iterdir()) == before and not out.exists()


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_staging_path_that_is_a_file_or_a_link_is_refused(capsys, source, pack, tmp_path, overwrite):
    (tmp_path / "o.partial").write_text("not mine")
    status, text = run_cli_merged(capsys, "repack", str(source), str(tmp_path / "o"), *overwrite)
    assert status == 2 and "o.partial" in text and "not a directory" in text and "Traceback" not in text, text
    assert (tmp_path / "o.partial").read_text() == "not mine"
    os.symlink(source, tmp_path / "t.partial")  # --to tr3 from a route pack: the link leads to another directory
    status, text = run_cli_merged(capsys, "repack", str(pack), str(tmp_path / "t"), "--to", "tr3", *overwrite)
    assert status == 2 and "t.partial" in text and "symbolic link" in text and "Traceback" not in text, text
    assert (source / "config.json").is_file()


@pytest.mark.parametrize("args, named", [
    (["--tp", "0"], "--tp 0"),
    (["--tp", "-2"], "--tp -2"),
    (["--tp", "0", "--to", "tr3"], "--tp 0"),
    (["--ranks", "0-99999999999"], "--ranks"),
    (["--layers", "0-99999999999"], "--layers"),
], ids=["tp-zero", "tp-negative", "tp-zero-tr3", "huge-ranks", "huge-layers"])
def test_bad_tp_and_huge_selections_are_usage_errors(capsys, source, tmp_path, args, named):
    status, text = run_cli_merged(capsys, "repack", str(source), str(tmp_path / "o"), *args)
    assert status == 2 and named in text and "Traceback" not in text, text
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_selection_names_the_missing_ids_without_expanding_the_range():
    from trellis_cli.errors import UsageError
    from trellis_cli.selection import parse_selection

    with pytest.raises(UsageError, match=r"--layers: \[5, 6, 7, 8, 9\] not in the source \(it has 3-4\)"):
        parse_selection("3-99999999999", [3, 4], "layers")
    assert parse_selection("3-4", [3, 4, 40], "layers") == [3, 4]


def _edited_source(source: Path, target: Path, **tail) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    config["hybrid_tr3_tail"].update(tail)
    (target / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return target


def test_an_invalid_source_is_refused_with_its_errors_listed(capsys, source, tmp_path):
    bad = _edited_source(source, tmp_path / "bad", codebook="x")
    status, text = run_cli_merged(capsys, "repack", str(bad), str(tmp_path / "o"))
    assert status == 1 and "FAIL" in text and "Traceback" not in text, text
    assert "error[config.tr3-codebook] config.json:hybrid_tr3_tail.codebook" in text and "more" not in text, text
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_many_errors_are_cut_short_with_a_pointer_to_validate(capsys, source, tmp_path):
    bad = _edited_source(source, tmp_path / "bad", tp=True)  # every rank-1 slice is then out of range
    status, text = run_cli_merged(capsys, "repack", str(bad), str(tmp_path / "o"))
    listed = [line for line in text.splitlines() if line.startswith("  error[")]
    assert status == 1 and len(listed) == 10, text
    assert f"more; run `trellis validate {bad}`" in text


@pytest.mark.parametrize("content, named", [(None, "files['config.json']"), ("[1]", "config.json"),
                                            ("{bad", "config.json")], ids=["absent", "list", "not-json"])
def test_a_missing_or_broken_pack_config_is_refused_by_to_tr3(capsys, pack, tmp_path, content, named):
    from trellis_cli.dialects.routepack.manifest import file_entry

    root = tmp_path / "p"
    shutil.copytree(pack, root)
    doc = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    if content is None:
        (root / "config.json").unlink()
        del doc["files"]["config.json"]
    else:  # listed with its true hash: only its content is wrong
        (root / "config.json").write_text(content, encoding="utf-8")
        doc["files"]["config.json"] = file_entry(root / "config.json", role="config")
    write_manifest(root, doc)
    status, text = run_cli_merged(capsys, "repack", str(root), str(tmp_path / "out"), "--to", "tr3")
    assert status == 1 and named in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_link_planted_in_a_stage_to_resume_is_refused_before_anything_is_written(capsys, source, tmp_path,
                                                                                  monkeypatch):
    """Resuming writes config.json into the stage: through a planted link it would change a file outside OUT."""
    from trellis_cli import RepackOptions, run_repack

    out = tmp_path / "out"
    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        interrupt_after(patch, 1)
        run_repack(source, out, RepackOptions(jobs=1))
    victim = tmp_path / "victim.txt"
    victim.write_text("ORIGINAL")
    (tmp_path / "out.partial" / "tree" / "config.json").symlink_to(victim)
    status, text = run_cli_merged(capsys, "repack", str(source), str(out))
    assert status == 2 and "config.json" in text and "refusing to resume" in text, text
    assert victim.read_text() == "ORIGINAL" and not out.exists()


def test_a_layer_file_entry_must_say_the_layer_and_rank_its_name_says(capsys, pack, tmp_path):
    def swap_ranks(doc):
        doc["files"]["layer-003-rank-0.safetensors"]["rank"] = 1
        doc["files"]["layer-003-rank-1.safetensors"]["rank"] = 0

    root = edited_pack(pack, tmp_path / "swapped", swap_ranks)
    status, text = run_cli_merged(capsys, "validate", str(root))
    assert status == 1 and "repack.manifest-field" in text and "layer-003-rank-0.safetensors" in text, text


def test_to_tr3_lists_nested_shards_in_its_checksum_manifest(capsys, source, tmp_path):
    """A source may keep shards in folders; the TR3 written back must still hash every file it holds."""
    from trellis_cli.integrity import CHECKSUM_MANIFEST, write_manifest as write_checksums

    nested = tmp_path / "nested"
    shutil.copytree(source, nested)
    (nested / "shards").mkdir()
    index_path = nested / "model.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    for shard in sorted({f for f in index["weight_map"].values()}):
        (nested / shard).rename(nested / "shards" / shard)
    index["weight_map"] = {k: f"shards/{v}" for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index), encoding="utf-8")
    write_checksums(nested, [p.relative_to(nested).as_posix() for p in nested.rglob("*")
                             if p.is_file() and p.name != CHECKSUM_MANIFEST])
    assert run_cli_merged(capsys, "repack", str(nested), str(tmp_path / "pack"))[0] == 0
    assert run_cli_merged(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")[0] == 0
    status, text = run_cli_merged(capsys, "validate", str(tmp_path / "back"), "--checksums")
    assert status == 0 and "checksum.unlisted" not in text, text
    assert (tmp_path / "back" / "shards").is_dir()
