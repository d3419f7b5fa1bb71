"""One comparison for every recorded sha256 (integrity.check_recorded) and one rule deciding which are compared
(validate/checksums.py): checked against hashlib on fresh random files."""

from __future__ import annotations

import hashlib
import os

from trellis_cli.dialects import open_checkpoint
from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
from trellis_cli.dialects.interface import CheckRequest
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import Location, Report
from trellis_cli.integrity import UNRECORDED_DIGEST, RecordedHash, check_recorded
from trellis_cli.sources import LocalSource
from trellis_cli.synth import preset, write_checkpoint
from trellis_cli.validate import run_validation
from trellis_cli.validate.checksums import NOT_HASHED_NOTE


def recorded(name: str, digest: str, size: int | None = None) -> RecordedHash:
    return RecordedHash(name, digest, Location(file=name), "test.mismatch", "differs", size)


def test_streamed_sha256_matches_hashlib_and_a_flipped_byte_is_the_dialects_finding(tmp_path):
    data = os.urandom(3 << 20 | 12345)  # several read chunks and a partial one
    (tmp_path / "a.bin").write_bytes(data)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    (tmp_path / "b.bin").write_bytes(bytes(flipped))
    truth = hashlib.sha256(data).hexdigest()
    report, seen = Report(subject="t"), []
    check_recorded(LocalSource(tmp_path), [recorded("a.bin", truth, len(data)), recorded("b.bin", truth)],
                   report, progress=seen.append)
    assert sum(seen) == 2 * len(data) and report.checked == {"bytes hashed": len(data)}
    [finding] = report.findings
    assert (finding.code, finding.where.file, finding.expected) == ("test.mismatch", "b.bin", truth)
    assert finding.found == hashlib.sha256(bytes(flipped)).hexdigest()


def test_a_known_digest_is_not_read_again_and_an_unreadable_file_is_a_finding(tmp_path):
    (tmp_path / "a.bin").write_bytes(os.urandom(4096))
    (tmp_path / "dir.bin").mkdir()
    report, seen = Report(subject="t"), []
    check_recorded(LocalSource(tmp_path), [recorded("a.bin", "f" * 64), recorded("dir.bin", "0" * 64)], report,
                   progress=seen.append, known={"a.bin": "f" * 64})
    assert seen == [] and [f.code for f in report.findings] == ["file.unreadable"]
    assert report.findings[0].where.file == "dir.bin"


def test_every_recorded_hash_of_a_dialect_goes_through_the_rule(tmp_path):
    root = write_exl3v1_checkpoint(tmp_path / "ex", preset("tiny"))
    ckpt = open_checkpoint(str(root))
    dialect = dialect_of(ckpt)
    hashes = dialect.recorded_hashes(ckpt, CheckRequest(layers=sorted(ckpt.layers), deep=False, checksums=False))
    assert hashes and all(r.code == "exl3v1.sha256-mismatch" for r in hashes)
    for r in hashes:  # what the manifest records is the file's sha256 (hashlib, not the project's reader)
        assert r.sha256 == hashlib.sha256((root / r.file).read_bytes()).hexdigest() != UNRECORDED_DIGEST
    report = run_validation(ckpt)
    assert report.checked["checksums"] == len(hashes) and NOT_HASHED_NOTE not in report.notes
    target = root / hashes[0].file
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0x40
    target.write_bytes(bytes(raw))
    report = run_validation(open_checkpoint(str(root)))  # the byte also breaks a rate table: its own finding
    [mismatch] = [f for f in report.errors if f.code == "exl3v1.sha256-mismatch"]
    assert mismatch.expected == hashes[0].sha256 and mismatch.found == hashlib.sha256(bytes(raw)).hexdigest()


def test_a_route_pack_says_its_hashes_were_compared(tmp_path):
    from trellis_cli.workflows import run_repack

    source = write_checkpoint(tmp_path / "src", preset("tiny"))
    run_repack(str(source), tmp_path / "rp")
    report = run_validation(open_checkpoint(str(tmp_path / "rp")))
    assert report.ok and report.checked["bytes hashed"] > 0 and NOT_HASHED_NOTE not in report.notes
