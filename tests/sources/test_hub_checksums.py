"""`validate --checksums` on a Hub source (issue 42, class 4): every cached file of an exl3-v1 repo is compared
with its Hub hash (LFS sha256, git blob sha1 for small files), not only the layer files with the manifest; a
snapshot link that resolves outside the cache is `path.escape` and never read, online and offline, for TR3 and
exl3-v1 alike. The real huggingface_hub client against the loopback Hub (tests/hub_server.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from helpers import run_cli
from hub_server import HubServer
from trellis_cli.synth import preset, shard_name, write_checkpoint

TR3_REPO, EXL3_REPO = "org/tiny-tr3", "org/tiny-exl3v1"
LAYER3 = "exl3-layer-00003.safetensors"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("served")
    tr3 = write_checkpoint(base / "tr3", preset("tiny"))
    exl3 = base / "exl3"
    status, _, err = run_cli(None, "synth", str(exl3), "--format", "exl3-v1", "--uniform", "3")
    assert status == 0, err
    (exl3 / "README.md").write_text("an exl3-v1 checkpoint\n")
    return {TR3_REPO: tr3, EXL3_REPO: exl3}


@pytest.fixture
def hub(served):
    with HubServer() as server:
        for repo, directory in served.items():
            server.add_commit(repo, directory)
        yield server


def validate(capsys, hub: HubServer, cache: Path, repo: str, *options: str) -> tuple[int, list[dict]]:
    status, out, err = run_cli(capsys, "validate", repo, "--endpoint", hub.endpoint, "--cache-dir", str(cache),
                               "--json", *options)
    assert "internal error" not in err and "Traceback" not in err, err
    return status, [f for f in json.loads(out)["findings"] if f["severity"] != "info"]


def snapshot(cache: Path, repo: str) -> Path:
    (folder,) = (cache / ("models--" + repo.replace("/", "--")) / "snapshots").iterdir()
    return folder


def cached_everything(capsys, hub, cache: Path, repo: str) -> Path:
    """An online --checksums run that downloads every file and passes; the snapshot folder it filled."""
    assert validate(capsys, hub, cache, repo, "--checksums") == (0, [])
    return snapshot(cache, repo)


def rewrite_cached(link: Path, change) -> None:
    blob = link.resolve()
    data = bytearray(blob.read_bytes())
    change(data)
    os.chmod(blob, 0o644)
    blob.write_bytes(bytes(data))


# ---- every exl3-v1 file against the Hub --------------------------------------------------------------

@pytest.mark.parametrize("offline", [False, True])
def test_exl3v1_files_outside_the_manifest_are_compared_with_the_hub(capsys, hub, tmp_path, offline):
    cache = tmp_path / "cache"
    snap = cached_everything(capsys, hub, cache, EXL3_REPO)
    rewrite_cached(snap / "README.md", lambda data: data.__setitem__(0, ord("A")))
    status, findings = validate(capsys, hub, cache, EXL3_REPO, "--checksums", *(("--offline",) if offline else ()))
    if offline:  # offline the cache's own record (a blob named by its hash) is what is compared
        assert status == 1 and [(f["code"], f["location"]["file"]) for f in findings] == [
            ("checksum.mismatch", "README.md")]
        return
    assert status == 1
    assert [(f["code"], f["location"]["file"]) for f in findings] == [("checksum.mismatch", "README.md")]


def test_a_consistently_altered_exl3v1_layer_and_manifest_fail_against_the_hub(capsys, hub, tmp_path):
    """The manifest's digest proves nothing when the manifest itself was altered to match: the Hub's hashes do."""
    cache = tmp_path / "cache"
    snap = cached_everything(capsys, hub, cache, EXL3_REPO)
    rewrite_cached(snap / LAYER3, lambda data: data.__setitem__(len(data) - 1, data[-1] ^ 0xFF))
    digest = hashlib.sha256((snap / LAYER3).read_bytes()).hexdigest()
    manifest = json.loads((snap / "exl3-manifest.json").read_text())
    manifest["layers"]["3"]["sha256"] = digest
    rewrite_cached(snap / "exl3-manifest.json", lambda data: data.__setitem__(slice(None),
                                                                             json.dumps(manifest).encode()))
    status, findings = validate(capsys, hub, cache, EXL3_REPO, "--checksums")
    assert status == 1
    assert sorted((f["code"], f["location"]["file"]) for f in findings) == [
        ("checksum.mismatch", LAYER3), ("checksum.mismatch", "exl3-manifest.json")]


# ---- snapshot links that leave the cache --------------------------------------------------------------

@pytest.mark.parametrize("repo, name", [(TR3_REPO, shard_name(3)), (EXL3_REPO, LAYER3), (TR3_REPO, "config.json")])
@pytest.mark.parametrize("offline", [False, True])
def test_a_snapshot_link_out_of_the_cache_is_path_escape_and_never_read(capsys, hub, tmp_path, repo, name, offline):
    cache = tmp_path / "cache"
    snap = cached_everything(capsys, hub, cache, repo)
    link = snap / name
    # An altered copy outside the cache, named like a blob (offline, that name stands in for the Hub's hash).
    planted = tmp_path / "elsewhere" / link.resolve().name
    planted.parent.mkdir()
    planted.write_bytes(link.resolve().read_bytes()[:-1] + b"\0")
    before = planted.read_bytes()
    link.unlink()
    link.symlink_to(planted)

    status, out, err = run_cli(capsys, "validate", repo, "--endpoint", hub.endpoint, "--cache-dir", str(cache),
                               "--json", "--checksums", *(("--offline",) if offline else ()))
    assert status == 1 and "internal error" not in err, err
    if name == "config.json":  # nothing can be trusted without it: the run stops, naming the escape
        assert json.loads(out)["findings"][0]["code"] == "checkpoint.unreadable"
        assert "outside the Hub cache folder" in json.loads(out)["findings"][0]["message"]
    else:
        findings = [f for f in json.loads(out)["findings"] if f["severity"] != "info"]
        named = {(f["code"], f["location"].get("file")) for f in findings}
        assert ("path.escape", name) in named, findings  # then what follows from it (the layer is empty, ...)
        assert all(f["severity"] == "error" for f in findings), findings
    assert planted.read_bytes() == before
