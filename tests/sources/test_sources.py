"""Sources without a network: spec parsing, local sources, layer ranges, file selection, local checksums."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from trellis_cli.cli.exit_codes import exit_code
from trellis_cli.errors import EXIT_SOURCE, CheckFailed, SourceUnavailable, UsageError
from trellis_cli.integrity import (
    MISMATCH, MISSING, NO_MANIFEST, OK, UNLISTED, UNSAFE_PATH, git_blob_sha1, sha256_file, verify_checksums,
)
from trellis_cli.selection import fetch_files, parse_layer_ranges, select_files
from trellis_cli.sources import LocalSource, open_source, parse_repo_spec


def _write_random(path: Path, size: int) -> bytes:
    data = random.randbytes(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    _write_random(root / "model-00001.safetensors", 70_001)
    _write_random(root / "sub" / "model-00002.safetensors", 3_333)
    (root / "config.json").write_text('{"hidden_size": 256}')
    lines = [f"{hashlib.sha256((root / n).read_bytes()).hexdigest()}  {n}"
             for n in ("config.json", "model-00001.safetensors", "sub/model-00002.safetensors")]
    (root / "MANIFEST.sha256").write_text("\n".join(lines) + "\n")
    return root


# ---- open_source -------------------------------------------------------------------------------------

def test_existing_directory_is_a_local_source(checkpoint_dir):
    source = open_source(str(checkpoint_dir))
    assert isinstance(source, LocalSource)
    assert source.list_files()["sub/model-00002.safetensors"] == 3_333
    assert source.describe()["kind"] == "local"


def test_revision_with_a_local_directory_is_a_usage_error(checkpoint_dir):
    with pytest.raises(UsageError, match="Hub repos only"):
        open_source(str(checkpoint_dir), revision="main")


@pytest.mark.parametrize("spec, message", [
    ("./no/such/dir", "no such file or directory"),
    ("/definitely/not/here", "no such file or directory"),
    ("not a repo!", "not an existing path and not a Hub repo id"),
    ("org/na--me", "not an existing path and not a Hub repo id"),
    ("single", "not an existing path and not a Hub repo id"),
    ("org/name@", "not an existing path and not a Hub repo id"),
])
def test_unusable_specs_name_themselves_and_exit_3(spec, message):
    with pytest.raises(SourceUnavailable) as info:
        open_source(spec)
    assert exit_code(info.value) == EXIT_SOURCE
    assert spec in str(info.value) and message in str(info.value)


def test_no_spec_opens_the_bundled_sample_or_says_it_is_missing():
    try:
        source = open_source(None)
    except SourceUnavailable as e:
        assert "bundled sample" in str(e)
    else:
        assert isinstance(source, LocalSource) and source.list_files()


@pytest.mark.parametrize("spec, expected", [
    ("org/name", ("org/name", None)),
    ("org/name@main", ("org/name", "main")),
    ("hf://org/name@v1.0", ("org/name", "v1.0")),
    ("hf://models/org/name", ("org/name", None)),
    ("Org-1/Name_2.x@" + "a" * 40, ("Org-1/Name_2.x", "a" * 40)),
    ("org/name/extra", None),
    ("-org/name", None),
    ("org/name.", None),
])
def test_parse_repo_spec(spec, expected):
    assert parse_repo_spec(spec) == expected


def test_revision_conflict_between_spec_and_option_is_a_usage_error():
    with pytest.raises(UsageError, match="conflicts"):
        open_source("org/name@v1", revision="v2", offline=True)


# ---- layer ranges and file selection -----------------------------------------------------------------

def test_parse_layer_ranges():
    assert parse_layer_ranges("3-5,40") == [3, 4, 5, 40]
    assert parse_layer_ranges(" 7 , 2-3,3 ") == [2, 3, 7]


@pytest.mark.parametrize("text", ["", "3-", "a", "5-3", "1,,2", "-4", "3-5-7"])
def test_bad_layer_ranges_are_usage_errors(text):
    with pytest.raises(UsageError, match="--layers"):
        parse_layer_ranges(text)


def test_select_files_takes_names_and_globs():
    files = ["config.json", "model-layer-003.safetensors", "model-layer-004.safetensors", "x/y.json"]
    assert select_files(files, ["model-layer-00[3]*", "config.json"]) == ["config.json",
                                                                          "model-layer-003.safetensors"]
    assert select_files(files, ["*.json"]) == ["config.json", "x/y.json"]
    with pytest.raises(SourceUnavailable, match="model-layer-009"):
        select_files(files, ["model-layer-009.safetensors"])


def test_fetch_files_on_a_local_source_is_the_directory_itself(checkpoint_dir):
    assert fetch_files(LocalSource(checkpoint_dir), ["*.safetensors"]) == checkpoint_dir


# ---- local checksums ---------------------------------------------------------------------------------

def test_hash_helpers_match_reference_values(tmp_path):
    data = _write_random(tmp_path / "blob", 1_234_567)
    seen: list[int] = []
    assert sha256_file(tmp_path / "blob", seen.append) == hashlib.sha256(data).hexdigest()
    assert sum(seen) == len(data)
    (tmp_path / "hello").write_bytes(b"hello\n")
    assert git_blob_sha1(tmp_path / "hello") == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object`


def test_manifest_checksums_pass_and_report_progress(checkpoint_dir):
    seen: list[int] = []
    results = verify_checksums(LocalSource(checkpoint_dir), progress=seen.append)
    assert [r.status for r in results] == [OK, OK, OK]
    hashed = [p for p in checkpoint_dir.rglob("*") if p.is_file() and p.name != "MANIFEST.sha256"]
    assert sum(seen) == sum(p.stat().st_size for p in hashed)


def test_manifest_mismatch_missing_and_unlisted_files(checkpoint_dir):
    shard = checkpoint_dir / "model-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[12_345] ^= 0x01  # same size, one bit: only a hash finds it
    shard.write_bytes(bytes(data))
    (checkpoint_dir / "sub" / "model-00002.safetensors").unlink()
    (checkpoint_dir / "extra.json").write_text("{}")
    by_file = {r.file: r for r in verify_checksums(LocalSource(checkpoint_dir))}
    assert by_file["model-00001.safetensors"].status == MISMATCH
    assert by_file["model-00001.safetensors"].found == hashlib.sha256(bytes(data)).hexdigest()
    assert by_file["sub/model-00002.safetensors"].status == MISSING
    assert by_file["extra.json"].status == UNLISTED
    assert by_file["config.json"].ok


def test_checksums_of_selected_files_only(checkpoint_dir):
    results = verify_checksums(LocalSource(checkpoint_dir), files=["config.json"])
    assert [(r.file, r.status) for r in results] == [("config.json", OK)]


def test_no_manifest_is_a_clear_result(checkpoint_dir):
    (checkpoint_dir / "MANIFEST.sha256").unlink()
    assert [r.status for r in verify_checksums(LocalSource(checkpoint_dir))] == [NO_MANIFEST]


def test_malformed_manifest_line_names_the_line(checkpoint_dir):
    with open(checkpoint_dir / "MANIFEST.sha256", "a") as f:
        f.write("not-a-hash  config.json\n")
    with pytest.raises(CheckFailed, match=r"MANIFEST.sha256:4"):
        verify_checksums(LocalSource(checkpoint_dir))


def test_manifest_paths_leaving_the_directory_are_refused(checkpoint_dir, tmp_path):
    outside = tmp_path / "secret"
    outside.write_bytes(b"x")
    with open(checkpoint_dir / "MANIFEST.sha256", "a") as f:
        f.write(f"{'0' * 64}  ../secret\n")
    if hasattr(os, "symlink"):
        os.symlink(outside, checkpoint_dir / "link")
        with open(checkpoint_dir / "MANIFEST.sha256", "a") as f:
            f.write(f"{'0' * 64}  link\n")
    by_file = {r.file: r.status for r in verify_checksums(LocalSource(checkpoint_dir))}
    assert by_file["../secret"] == UNSAFE_PATH
    assert by_file.get("link", UNSAFE_PATH) == UNSAFE_PATH
