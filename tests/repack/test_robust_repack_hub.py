"""Hostile input to repack from the Hub (issue 42, classes 2 and 3), through the loopback Hub and the real client:
OUT never overlaps the source's snapshot, its blobs, the cache root or HF_HOME (and `--overwrite` deletes none of
them), and corrupt cached or served bytes are refused, never converted. Every refusal leaves the whole tree
(cache included) byte-identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import exl3v1_from_tr3, run_cli_merged, tree_snapshot
from hub_server import HubServer
from trellis_cli.sources import open_source

REPO = "org/exl3"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return exl3v1_from_tr3(tmp_path_factory.mktemp("conv"))


@pytest.fixture
def hub(converted):
    with HubServer() as server:
        server.main_sha = server.add_commit(REPO, converted)
        yield server


def fill_cache(hub: HubServer, cache: Path) -> Path:
    """Download every file of the repo into `cache`; the snapshot folder."""
    source = open_source(REPO, endpoint=hub.endpoint, cache_dir=cache)
    for name in source.list_files():
        source.local_path(name)
    return cache / "models--org--exl3" / "snapshots" / hub.main_sha


def offline_repack(capsys, cache: Path, out: Path, *args: str) -> tuple[int, str]:
    return run_cli_merged(capsys, "repack", REPO, str(out), "--offline", "--cache-dir", str(cache), *args)


# ---- class 2: OUT never overlaps a Hub source -------------------------------------------------------------

@pytest.mark.parametrize("where", ["cache", "repo", "snapshot", "inside-snapshot", "blobs", "inside-blobs",
                                   "above-cache", "in-cache"])
@pytest.mark.parametrize("to", ["tr3", "route-pack"])
def test_out_overlapping_the_hub_cache_is_refused_and_nothing_is_deleted(capsys, hub, tmp_path, where, to):
    cache = tmp_path / "hf" / "hub"
    snapshot = fill_cache(hub, cache)
    (tmp_path / "hf" / "unrelated.txt").write_text("keep me")
    out = {"cache": cache, "repo": snapshot.parent.parent, "snapshot": snapshot, "inside-snapshot": snapshot / "o",
           "blobs": snapshot.parent.parent / "blobs", "inside-blobs": snapshot.parent.parent / "blobs" / "o",
           "above-cache": tmp_path / "hf", "in-cache": cache / "elsewhere"}[where]
    before = tree_snapshot(tmp_path)
    code, text = offline_repack(capsys, cache, out, "--to", to, "--overwrite")
    assert code == 2, text
    assert "refusing" in text and "internal error" not in text
    assert tree_snapshot(tmp_path) == before


def test_hf_home_as_out_with_overwrite_deletes_nothing(hub, tmp_path):
    """`HF_HUB_OFFLINE=1 trellis repack org/model $HF_HOME --overwrite`, HF_HOME set in a real process."""
    home = tmp_path / "hf"
    fill_cache(hub, home / "hub")
    (home / "token").write_text("not a token")
    before = tree_snapshot(tmp_path)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("HF_HUB_CACHE", None)
    for out in (home, home / "hub"):
        run = subprocess.run([sys.executable, "-m", "trellis_cli", "repack", REPO, str(out), "--to", "tr3",
                              "--overwrite"], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        assert "refusing" in run.stderr
    assert tree_snapshot(tmp_path) == before


def test_out_beside_the_cache_still_works(capsys, hub, tmp_path):
    cache = tmp_path / "hf" / "hub"
    fill_cache(hub, cache)
    before = tree_snapshot(cache)
    code, text = offline_repack(capsys, cache, tmp_path / "out", "--to", "tr3")
    assert code == 0, text
    assert tree_snapshot(cache) == before


# ---- class 3: corrupt bytes from the Hub are refused ------------------------------------------------------

@pytest.mark.parametrize("to", ["tr3", "route-pack"])
def test_a_corrupt_cached_blob_is_refused(capsys, hub, tmp_path, to):
    cache = tmp_path / "cache"
    snapshot = fill_cache(hub, cache)
    blob = (snapshot / "exl3-layer-00003.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the codes, same size
    blob.write_bytes(bytes(data))
    before = tree_snapshot(tmp_path)
    code, text = offline_repack(capsys, cache, tmp_path / "out", "--to", to)
    assert code == 1, text
    assert "exl3-layer-00003.safetensors" in text and "sha256" in text
    assert "[exl3v1.sha256-mismatch]" in text or "[checksum.mismatch]" in text
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert tree_snapshot(tmp_path) == before


def test_a_corrupt_download_is_refused(capsys, hub, tmp_path):
    """The server sends one flipped byte while the listing still states the original sha256."""
    hub.corrupt(REPO, hub.main_sha, "exl3-layer-00004.safetensors")
    code, text = run_cli_merged(capsys, "repack", REPO, str(tmp_path / "out"), "--to", "tr3", "--endpoint",
                                hub.endpoint, "--cache-dir", str(tmp_path / "cache"))
    assert code == 1 and "[exl3v1.sha256-mismatch]" in text, text
    assert "exl3-layer-00004.safetensors" in text and "internal error" not in text
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("to", ["tr3", "route-pack", "exl3-v1"])
def test_a_tr3_shard_that_differs_from_its_lfs_sha256_is_refused(capsys, converted, tmp_path, to):
    with HubServer() as hub:
        sha = hub.add_commit("org/tr3", converted.parent / "tr3")
        hub.corrupt("org/tr3", sha, "model-layer-004.safetensors")
        args = ["--tp", "1"] if to == "tr3" else []
        code, text = run_cli_merged(capsys, "repack", "org/tr3", str(tmp_path / "out"), "--to", to, *args,
                                    "--endpoint", hub.endpoint, "--cache-dir", str(tmp_path / "cache"))
    assert code == 1 and "[checksum.mismatch]" in text and "the Hub's LFS sha256" in text, text
    assert "model-layer-004.safetensors" in text
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
