"""Route-pack verification on hostile manifests and damaged files: bounded work, and the pack's own findings.

A manifest is small, but what it declares (layers x ranks, files, tiers) is untrusted: verification must cost
what the directory holds, never what the manifest claims. A pack's config.json is one of its hashed files, so
damage to it is the verifier's finding, and the other pack checks still run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import edited_pack, run_cli, run_cli_merged
from trellis_cli import synth
from trellis_cli.dialects.routepack.manifest import file_entry, write_manifest

REPO = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 512 << 20  # address space for the whole CLI process; the unbounded loop needed > 4 GB


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    from trellis_cli import run_repack

    source = synth.write_checkpoint(tmp_path_factory.mktemp("packverify") / "src", synth.preset("tiny"))
    return run_repack(source, source.parent / "pack").out


def declaring(pack: Path, target: Path, layers: int, ranks: int) -> Path:
    """A copy of `pack` without its layer files whose manifest declares `layers` x `ranks` of them."""
    def edit(doc):
        for name in [n for n, e in doc["files"].items() if "layer" in e]:
            (target / name).unlink()
            del doc["files"][name]
        doc["tp"], doc["ranks"] = ranks, list(range(ranks))
        doc["layers"] = {str(i): {"tiers": [{"k": 3, "size": 8, "experts": "0-7"}]} for i in range(layers)}

    return edited_pack(pack, target, edit)


def validate_json(capsys, root: Path) -> tuple[int, dict]:
    status, out, _ = run_cli(capsys, "validate", str(root), "--json")
    return status, json.loads(out)


def run_limited(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The real CLI in a subprocess under an address-space limit; (result, seconds)."""
    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trellis_cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=limit_memory)
    return done, time.monotonic() - start


def test_a_manifest_declaring_millions_of_layer_files_is_one_finding(pack, tmp_path):
    root = declaring(pack, tmp_path / "p", 5000, 5000)
    assert (root / "manifest.json").stat().st_size < 1 << 20
    done, seconds = run_limited("validate", str(root), "--json")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    findings = json.loads(done.stdout)["findings"]
    assert [f["code"] for f in findings] == ["count.implausible"], findings
    assert findings[0]["found"] == 25_000_000 and "layers, ranks" in findings[0]["location"]["tensor"]
    assert seconds < 5, seconds

    out = tmp_path / "out"
    done, seconds = run_limited("repack", str(root), str(out), "--to", "tr3")
    assert done.returncode == 1 and "count.implausible" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert seconds < 5 and not out.exists() and not out.with_name("out.partial").exists()


def test_missing_layer_files_below_the_bound_are_listed_up_to_the_cap_with_the_total(capsys, pack, tmp_path):
    root = declaring(pack, tmp_path / "p", 60, 60)
    status, document = validate_json(capsys, root)
    findings = document["findings"]
    missing = [f for f in findings if f["code"] == "repack.missing-file"]
    assert status == 1 and len(missing) == 51, findings
    assert missing[0]["location"] == {"file": "layer-000-rank-0.safetensors", "layer": 0, "rank": 0}
    assert "3550 more layer files" in missing[-1]["message"] and missing[-1]["found"] == "3600 not listed"


def test_a_manifest_listing_more_files_than_the_directory_holds_is_one_finding(capsys, pack, tmp_path):
    def many_files(doc):
        for i in range(20_000):
            doc["files"][f"ghost-{i}.json"] = {"sha256": "0" * 64, "size": 1}

    root = edited_pack(pack, tmp_path / "p", many_files)
    listed = len(json.loads((root / "manifest.json").read_text(encoding="utf-8"))["files"])
    status, document = validate_json(capsys, root)
    findings = document["findings"]
    assert status == 1 and [f["code"] for f in findings] == ["count.implausible"], findings
    assert findings[0]["location"]["tensor"] == "files" and findings[0]["found"] == listed


def test_manifest_field_findings_are_capped_while_made(capsys, pack, tmp_path):
    def bad_entries(doc):
        for i in range(3000):
            doc["files"][f"bad-{i}"] = i

    root = edited_pack(pack, tmp_path / "p", bad_entries)
    status, document = validate_json(capsys, root)
    findings = document["findings"]
    assert status == 1 and len(findings) == 51 and {f["code"] for f in findings} == {"repack.manifest-field"}
    assert "2950 more repack.manifest-field finding(s) in the manifest" in findings[-1]["message"], findings[-1]


def _damage_config(root: Path, how: str) -> None:
    path = root / "config.json"
    data = bytearray(path.read_bytes())
    if how == "digit":  # still valid JSON: only the hash can tell
        at = data.index(b"256")
        data[at] = ord("3")
    else:  # the first byte: not JSON at all
        data[0] = ord("x")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["digit", "not-json"])
def test_a_flipped_byte_in_the_pack_config_is_the_packs_hash_mismatch(capsys, pack, tmp_path, how):
    root = tmp_path / "p"
    shutil.copytree(pack, root)
    _damage_config(root, how)
    status, document = validate_json(capsys, root)
    codes = {(f["code"], f["location"].get("file")) for f in document["findings"]}
    assert status == 1 and ("repack.hash-mismatch", "config.json") in codes, codes
    assert "checkpoint.unreadable" not in json.dumps(document)
    assert document["context"]["dialect"] == "trellis-route-pack"
    assert document["checked"]["layer files"] == 4  # the remaining pack checks still ran
    status, text = run_cli_merged(capsys, "repack", str(root), str(tmp_path / "out"), "--to", "tr3")
    assert status == 1 and "repack.hash-mismatch" in text and "config.json" in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, found", [("{bad", "not valid JSON"), ("[1]", "list")], ids=["not-json", "list"])
def test_a_pack_config_that_is_not_a_json_object_is_the_verifiers_finding(capsys, pack, tmp_path, content, found):
    """Listed with its true hash, so only parsing it tells: validate must not pass what --to tr3 refuses."""
    root = tmp_path / "p"
    shutil.copytree(pack, root)
    (root / "config.json").write_text(content, encoding="utf-8")
    doc = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    doc["files"]["config.json"] = file_entry(root / "config.json", role="config")
    write_manifest(root, doc)
    status, text = run_cli_merged(capsys, "validate", str(root))
    assert status == 1 and "error[repack.config] config.json" in text and found in text, text
    assert "checkpoint.unreadable" not in text and "4 layer files" in text
    status, text = run_cli_merged(capsys, "repack", str(root), str(tmp_path / "out"), "--to", "tr3")
    assert status == 1 and "repack.config" in text, text


def test_a_manifest_nested_too_deeply_is_refused_without_a_traceback(capsys, pack, tmp_path):
    root = tmp_path / "p"
    shutil.copytree(pack, root)
    (root / "manifest.json").write_text("[" * 100_000, encoding="utf-8")
    for args in (("validate", str(root)), ("repack", str(root), str(tmp_path / "out"), "--to", "tr3")):
        status, text = run_cli_merged(capsys, *args)
        assert status == 1 and "manifest.json" in text and "Traceback" not in text, text


def test_layers_on_a_route_pack_mean_what_they_mean_on_a_checkpoint(capsys, pack):
    """A layer the pack lacks is a usage error in validate and inspect; inspect shows only the chosen layers, and
    validate says the selection does not narrow the pack's checks."""
    for command in ("validate", "inspect"):
        code, out, err = run_cli(capsys, command, str(pack), "--layers", "9", "--json")
        assert code == 2 and out == "" and "--layers: [9] not in the source (it has 3-4)" in err, err
    code, out, _ = run_cli(capsys, "inspect", str(pack), "--layers", "4", "--json")
    assert code == 0 and [row["layer"] for row in json.loads(out)["route_pack"]["layers"]] == [4]
    code, out, _ = run_cli(capsys, "validate", str(pack), "--layers", "4", "--json")
    doc = json.loads(out)
    assert code == 0 and any("--layers does not narrow" in note for note in doc["notes"]), doc["notes"]


def test_route_pack_hashing_reports_its_progress(pack):
    """The bytes hashed reach the progress callback (the CLI's sha256 bar) as they are read."""
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.validate import run_validation

    seen: list[int] = []
    report = run_validation(open_checkpoint(pack), checksum_progress=seen.append)
    hashed = sum(p.stat().st_size for p in pack.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert report.ok and sum(seen) == report.checked["bytes hashed"] == hashed and len(seen) >= 2
