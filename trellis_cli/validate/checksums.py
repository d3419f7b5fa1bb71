"""The checksum rule, one for every dialect: which recorded hashes a validation compares, and when.

Two kinds of record, one comparison (integrity.py):
- the publisher's: the Hub's LFS sha256 of each file, or a local MANIFEST.sha256 (`integrity.verify_checksums`),
  compared with --checksums; findings `checksum.*`;
- the format's own: what a dialect's metadata records for its files (`Dialect.recorded_hashes`: an exl3-v1
  manifest's per-layer digests; a route pack's manifest.json, compared by its verifier, which repack runs
  too), compared with --checksums and, where the dialect says so (`hashes_by_default`: local bytes), always.
  Each file is read once: a digest the publisher's comparison already produced is reused. A recorded digest
  of all zeros records nothing (a sparse synth's) and is compared only with --checksums.
"""

from __future__ import annotations

from typing import Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import CheckRequest, Dialect
from trellis_cli.findings import Finding, Location, Report, Severity
from trellis_cli.sources import Source

# Said when a dialect records hashes that this run did not compare.
NOT_HASHED_NOTE = "recorded hashes not compared (the files are not local; --checksums hashes them)"

CHECKSUM_CODES = {  # integrity status -> (code, severity, message)
    "mismatch": ("checksum.mismatch", Severity.ERROR, "sha256 differs from the recorded hash"),
    "missing": ("checksum.missing", Severity.ERROR, "a hash is recorded but the file is absent"),
    "unsafe-path": ("path.escape", Severity.ERROR, "the checksum manifest names a path outside the checkpoint"),
    "malformed": ("checksum.manifest", Severity.ERROR, "MANIFEST.sha256 line cannot be used"),
    "unreadable": ("file.unreadable", Severity.ERROR, "the file cannot be read"),
    "unlisted": ("checksum.unlisted", Severity.WARNING, "no hash is recorded for this file"),
    "no-manifest": ("checksum.unavailable", Severity.ERROR, "--checksums asked for, but there is no MANIFEST.sha256: "
                    "nothing to compare against, so no file was checked"),
    "not-cached": ("checksum.not-cached", Severity.WARNING, "not in the local cache, so not hashed"),
}


def publisher_first(checkpoint: Checkpoint, dialect: Dialect, checksums: bool, report: Report,
                    progress: Callable[[int], None] | None) -> dict[str, str]:
    """Before the dialect's rules, with --checksums: where the publisher's digest of a file is the one the
    dialect records too (`publisher_digests`), compare the publisher's first and return the digests found
    (file -> hex), so that no file is read twice."""
    if not (checksums and dialect.publisher_digests and _has_publisher_hashes(checkpoint.source)):
        return {}
    return compare_publisher(checkpoint, report, progress)


def compare_recorded(checkpoint: Checkpoint, dialect: Dialect, request: CheckRequest, report: Report) -> None:
    """After the dialect's rules: its own recorded hashes, when asked for or by the dialect's default."""
    from trellis_cli.integrity import UNRECORDED_DIGEST, check_recorded

    if not (request.checksums or dialect.hashes_by_default(checkpoint)):
        return  # said in the notes by `after_rules`
    recorded = dialect.recorded_hashes(checkpoint, request)
    if not recorded:
        return
    compared = [r for r in recorded if request.checksums or r.sha256 != UNRECORDED_DIGEST]
    check_recorded(checkpoint.source, compared, report, request.checksum_progress, request.known_digests)
    report.count("checksums", len(compared))
    if len(compared) < len(recorded):
        report.notes.append(f"sha256 not compared for {len(recorded) - len(compared)} layer file(s) whose manifest "
                            "digest is all zeros (none recorded; --checksums hashes them)")


def after_rules(checkpoint: Checkpoint, dialect: Dialect, checksums: bool, report: Report,
                progress: Callable[[int], None] | None) -> None:
    """After every other rule: with --checksums, the shards of a per-linear dialect against the publisher's;
    without, a note where the dialect's recorded hashes were left uncompared."""
    if checksums and dialect.shard_rules:
        compare_publisher(checkpoint, report, progress)
    elif not checksums and dialect.records_hashes and not dialect.hashes_by_default(checkpoint):
        report.notes.append(NOT_HASHED_NOTE)


def compare_publisher(ckpt: Checkpoint, report: Report, progress: Callable[[int], None] | None) -> dict[str, str]:
    """The publisher's hashes as findings in `report`; returns the sha256 found for each file hashed."""
    from trellis_cli.integrity import verify_checksums

    results = verify_checksums(ckpt.source, progress=progress, strict_manifest=False)
    report.count("checksums", sum(r.ok for r in results))
    found = {r.file: r.found for r in results if r.found is not None and len(r.found) == 64}
    for r in results:
        if r.ok:
            continue
        code, severity, message = CHECKSUM_CODES.get(r.status, ("checksum.mismatch", Severity.ERROR, r.status))
        report.findings.append(Finding(code, severity, Location(file=r.file), r.detail or message,
                                       expected=r.expected, found=r.found))
    return found


def _has_publisher_hashes(source: Source) -> bool:
    """A Hub repo (LFS sha256 per file), or a local directory that carries a MANIFEST.sha256. A directory
    without one still has its format's recorded digests, so it is not an error there."""
    from trellis_cli.integrity import CHECKSUM_MANIFEST
    from trellis_cli.sources import LocalSource

    return not isinstance(source, LocalSource) or CHECKSUM_MANIFEST in source.list_files()
