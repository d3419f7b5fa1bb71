"""Checksums: file content against the hashes the publisher recorded.

- Hub: LFS files against the sha256 the Hub lists (model_info with files metadata; offline, the cache
  names each LFS blob by that sha256); small non-LFS files against their git blob sha1.
- Local: against `MANIFEST.sha256` (`<hex>  <name>` lines, as `sha256sum` writes them), when present.

Files are hashed in 1 MiB reads on a small thread pool (hashlib releases the GIL on large updates).
huggingface_hub's verify_repo_checksums is not used: it hashes one file at a time with no progress, reads
non-LFS files whole, and reports every file of the repo that was not downloaded as missing.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from trellis_cli.errors import CheckFailed
from trellis_cli.sources import HubSource, LocalSource, Source, safe_relative

MANIFEST = "MANIFEST.sha256"
READ_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))

OK = "ok"
MISMATCH = "mismatch"
MISSING = "missing"  # listed with a hash, but the file is not there
UNLISTED = "unlisted"  # the file is there, but no hash is recorded for it
NO_MANIFEST = "no-manifest"  # a local directory without MANIFEST.sha256: nothing to compare
NOT_CACHED = "not-cached"  # Hub file not in the local cache and downloading was not allowed
UNSAFE_PATH = "unsafe-path"  # a manifest line naming a path outside the checkpoint

ProgressCallback = Callable[[int], None]
_MANIFEST_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


class ChecksumResult(NamedTuple):
    """One file's verdict. `expected`/`found` are sha256 hex, or git blob sha1 (40 hex) for non-LFS Hub files."""

    file: str
    expected: str | None
    found: str | None
    status: str

    @property
    def ok(self) -> bool:
        return self.status == OK


def verify_checksums(source: Source, files: Iterable[str] | None = None, progress: ProgressCallback | None = None,
                     *, download: bool = True, download_progress: ProgressCallback | None = None,
                     ) -> list[ChecksumResult]:
    """Hash `files` (default: every file with a recorded hash) and compare; results sorted by file name.

    `progress(n)` receives bytes hashed. A Hub source downloads missing files into the cache first
    (reporting to `download_progress`) unless `download=False`, which reports them as not-cached.
    """
    if isinstance(source, HubSource):
        expected = _hub_expected(source, files)
        paths = {name: _hub_local(source, name, download, download_progress) for name in expected}
        extra: list[ChecksumResult] = []
        missing = NOT_CACHED
    elif isinstance(source, LocalSource):
        manifest = read_manifest(source)
        if manifest is None:
            return [ChecksumResult(MANIFEST, None, None, NO_MANIFEST)]
        expected, paths, extra = _local_plan(source, manifest, files)
        missing = MISSING
    else:
        raise TypeError(f"verify_checksums: unsupported source {type(source).__name__}")
    results = _hash_all(expected, paths, progress, missing)
    return sorted(results + extra, key=lambda r: r.file)


# ---- what to compare ----------------------------------------------------------------------------------

def _hub_expected(source: HubSource, files: Iterable[str] | None) -> dict[str, str | None]:
    names = list(files) if files is not None else list(source.list_files())
    out: dict[str, str | None] = {}
    for name in names:
        info = source.file_info(name)
        out[name] = info.lfs_sha256 or info.blob_id
    return out


def _hub_local(source: HubSource, name: str, download: bool, progress: ProgressCallback | None) -> Path | None:
    cached = source.cached_path(name)
    if cached is not None or not download or source.offline:
        return cached
    return source.local_path(name, progress=progress)


def read_manifest(source: LocalSource) -> dict[str, str] | None:
    """MANIFEST.sha256 as {name: sha256}, or None when the checkpoint has none. Malformed lines raise."""
    path = source.root / MANIFEST
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckFailed(f"{MANIFEST}: larger than the {MAX_MANIFEST_BYTES}-byte limit")
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _MANIFEST_LINE.fullmatch(line.rstrip())
        if match is None:
            raise CheckFailed(f"{MANIFEST}:{number}: expected '<64 hex>  <file name>', found {line[:80]!r}")
        name = match.group(2)
        if name in entries:
            raise CheckFailed(f"{MANIFEST}:{number}: {name} is listed twice")
        entries[name] = match.group(1).lower()
    return entries


def _local_plan(source: LocalSource, manifest: dict[str, str], files: Iterable[str] | None):
    wanted = set(files) if files is not None else set(manifest) | set(source.list_files())
    wanted.discard(MANIFEST)
    expected: dict[str, str | None] = {}
    paths: dict[str, Path | None] = {}
    extra: list[ChecksumResult] = []
    for name in sorted(wanted):
        if name in manifest and (not safe_relative(name) or source.escapes(name)):
            extra.append(ChecksumResult(name, manifest[name], None, UNSAFE_PATH))
            continue
        path = source.root / name
        expected[name] = manifest.get(name)
        paths[name] = path if path.is_file() else None
    return expected, paths, extra


# ---- hashing ------------------------------------------------------------------------------------------

def _hash_all(expected: dict[str, str | None], paths: dict[str, Path | None],
              progress: ProgressCallback | None, missing_status: str) -> list[ChecksumResult]:
    lock = threading.Lock()

    def report(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    def check(name: str) -> ChecksumResult:
        want, path = expected[name], paths[name]
        if path is None:
            return ChecksumResult(name, want, None, missing_status)
        if want is None:
            return ChecksumResult(name, None, None, UNLISTED)
        found = git_blob_sha1(path, report) if len(want) == 40 else sha256_file(path, report)
        return ChecksumResult(name, want, found, OK if found == want.lower() else MISMATCH)

    with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
        return list(pool.map(check, sorted(expected)))


def sha256_file(path: str | os.PathLike, progress: ProgressCallback | None = None) -> str:
    return _digest(hashlib.sha256(), path, progress)


def write_manifest(directory: str | os.PathLike, names: Iterable[str]) -> Path:
    """Write `MANIFEST.sha256` in `directory` for the named files (`<hex>  <name>` lines, sorted)."""
    directory = Path(directory)
    lines = [f"{sha256_file(directory / name)}  {name}\n" for name in sorted(names)]
    path = directory / MANIFEST
    path.write_text("".join(lines), encoding="utf-8")
    return path


def git_blob_sha1(path: str | os.PathLike, progress: ProgressCallback | None = None) -> str:
    """The git object id of a file's content (what the Hub lists as blobId for non-LFS files)."""
    digest = hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    return _digest(digest, path, progress)


def _digest(digest, path, progress: ProgressCallback | None) -> str:
    # Reads into one reused buffer: fresh chunk allocations page-fault on every read and cost several
    # times the hashing itself (measured in repack's read-back).
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            if progress is not None:
                progress(n)
    return digest.hexdigest()
