"""Hostile checkpoints that validate once passed but a loader, or safetensors itself, refuses; and a checksum
manifest that `sha256sum -c` accepts but validate refused.

Each case damages a fresh copy of the `tiny` synth checkpoint and runs `trellis validate` in-process; the
safetensors cases also open the damaged file with the real `safetensors` library, so the test states what it
refuses rather than what we believe it refuses.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from test_checkpoint import synth
from test_repack_cli import run_cli
from trellis_cli.integrity import MANIFEST


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("base"))


@pytest.fixture
def ckpt(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ckpt", symlinks=True))


def validate(capsys, root: Path, *flags: str) -> tuple[int, list[dict]]:
    code, out, _ = run_cli(capsys, "validate", str(root), "--json", *flags)
    return code, json.loads(out)["findings"]


def codes(found: list[dict]) -> set[str]:
    return {f["code"] for f in found}


# ---- MANIFEST.sha256 as sha256sum writes and reads it -------------------------------------------------

ODD_NAMES = ("notes ", " lead.txt", "tab\there.txt", "new\nline.txt")


def _sha256sum(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sha256sum", *args], cwd=root, capture_output=True, timeout=60)


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
def test_manifest_written_by_sha256sum_is_read_as_sha256sum_reads_it(ckpt, capsys):
    for i, name in enumerate(ODD_NAMES):
        (ckpt / name).write_bytes(b"odd %d\n" % i)
    names = sorted(p.name for p in ckpt.iterdir() if p.name != MANIFEST)
    text = _sha256sum(ckpt, "--", *names[:3]).stdout  # text mode: two spaces
    text += _sha256sum(ckpt, "-b", "--", *names[3:-1]).stdout  # binary mode: " *"; escaped names start "\"
    text += _sha256sum(ckpt, "--tag", "--", names[-1]).stdout  # BSD tagged form
    (ckpt / MANIFEST).write_bytes(text.replace(b"\n", b"\r\n", 1))  # one CRLF line, as a Windows editor saves
    assert _sha256sum(ckpt, "-c", "--strict", MANIFEST).returncode == 0
    code, found = validate(capsys, ckpt, "--checksums")
    assert code == 0 and not [f for f in found if f["code"].startswith("checksum.")], found

    (ckpt / "notes ").write_bytes(b"changed\n")  # the name with the trailing space is the one hashed
    assert _sha256sum(ckpt, "-c", MANIFEST).returncode == 1
    code, found = validate(capsys, ckpt, "--checksums")
    assert code == 1 and [f["location"] for f in found if f["code"] == "checksum.mismatch"] == [{"file": "notes "}]


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
@pytest.mark.parametrize("line", [
    "\\{h}  bad\\qescape",  # only \\, \n and \r may be escaped
    "{h}",  # no name
    "{h}**x",  # no blank after the hash
    "{h} x",  # the reversed form after lines of the two-space form
])
def test_lines_sha256sum_refuses_are_malformed(ckpt, capsys, line):
    with open(ckpt / MANIFEST, "a") as f:
        f.write(line.format(h="0" * 64) + "\n")
    assert b"1 line is improperly formatted" in _sha256sum(ckpt, "-c", MANIFEST).stderr
    code, found = validate(capsys, ckpt, "--checksums")
    assert code == 1 and [f["location"] for f in found if f["code"] == "checksum.manifest"] == [
        {"file": f"{MANIFEST}:6"}]
