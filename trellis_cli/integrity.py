"""Checksums: file content against recorded hashes, and the one comparison every recorded sha256 goes through.

- Recorded by the format (`RecordedHash`): what a dialect's own metadata states for its files (an exl3-v1
  manifest's per-layer digests, a route pack's manifest.json); `check_recorded` streams each file through
  sha256 (or reuses a digest this run already has) and reports a mismatch with the dialect's finding code.

- Hub: LFS files against the sha256 the Hub lists (model_info with files metadata; offline, the cache
  names each LFS blob by that sha256); small non-LFS files against their git blob sha1.
- Local: against `MANIFEST.sha256` when present, read as `sha256sum -c` reads it (GNU coreutils): `<hex>  <name>`
  or `<hex> *<name>` (a single space or tab also works), names exactly as written up to the line end (trailing
  spaces kept, one CR before the newline dropped), a leading `\\` marking a name escaped as `\\\\`, `\\n`, `\\r`,
  and the tagged `SHA256 (<name>) = <hex>` form.

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
from trellis_cli.findings import Location, Report, error
from trellis_cli.header import open_regular, os_reason, text_escape
from trellis_cli.header import safe_relative
from trellis_cli.sources import HubSource, LocalSource, Source

# The checksum manifest of a checkpoint (a route pack's manifest.json is formats/layer_pack.py MANIFEST_NAME).
CHECKSUM_MANIFEST = "MANIFEST.sha256"
READ_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))

OK = "ok"
MISMATCH = "mismatch"
MISSING = "missing"  # listed with a hash, but the file is not there
UNLISTED = "unlisted"  # the file is there, but no hash is recorded for it
NO_MANIFEST = "no-manifest"  # a local directory without MANIFEST.sha256: nothing to compare
NOT_CACHED = "not-cached"  # Hub file not in the local cache and downloading was not allowed
UNSAFE_PATH = "unsafe-path"  # a manifest line naming a path outside the checkpoint, or the manifest a link out
MALFORMED = "malformed"  # a MANIFEST.sha256 line that cannot be used (the other lines still count)
UNREADABLE = "unreadable"  # the file (or the manifest) cannot be read: permissions, I/O error, not a regular file

ProgressCallback = Callable[[int], None]
# sha256sum -c's grammar: optional leading blanks, an optional `\` (escaped name), 64 hex digits, one blank, then
# the rest: ` name` / `*name` (text / binary mode, the same bytes are hashed), or `name` alone (the reversed
# BSD form); which of the two a file uses is fixed by its first such line, as sha256sum fixes it.
_MANIFEST_LINE = re.compile(r"[ \t]*(\\?)([0-9a-fA-F]{64})[ \t](.*)", re.DOTALL)
_TAGGED_LINE = re.compile(r"[ \t]*(\\?)SHA256 \((.+)\) = ([0-9a-fA-F]{64})", re.DOTALL)
_UNESCAPES = {"\\\\": "\\", "\\n": "\n", "\\r": "\r"}
_ESCAPE_SEQUENCE = re.compile(r"\\.?", re.DOTALL)


class ChecksumResult(NamedTuple):
    """One file's verdict. `expected`/`found` are sha256 hex, or git blob sha1 (40 hex) for non-LFS Hub files;
    `detail` says what went wrong where a status alone does not (which manifest line, which OS error)."""

    file: str
    expected: str | None
    found: str | None
    status: str
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK


def verify_checksums(source: Source, files: Iterable[str] | None = None, progress: ProgressCallback | None = None,
                     *, download: bool = True, download_progress: ProgressCallback | None = None,
                     strict_manifest: bool = True) -> list[ChecksumResult]:
    """Hash `files` (default: every file with a recorded hash) and compare; results sorted by file name.

    `progress(n)` receives bytes hashed. A Hub source downloads missing files into the cache first
    (reporting to `download_progress`) unless `download=False`, which reports them as not-cached.
    A malformed or unreadable MANIFEST.sha256 raises CheckFailed naming the line, unless
    `strict_manifest=False`: then each bad line is a `malformed` result and the other lines are checked.
    """
    if isinstance(source, HubSource):
        expected = _hub_expected(source, files)
        extra: list[ChecksumResult] = []
        paths = {}
        for name in list(expected):
            if source.escapes(name):  # a link out of the cache: never hashed, whatever its target is named
                extra.append(ChecksumResult(name, expected.pop(name), None, UNSAFE_PATH, "the cached file is a link "
                                            "that resolves outside the Hub cache: not read"))
                continue
            paths[name] = _hub_local(source, name, download, download_progress)
        missing = NOT_CACHED
    elif isinstance(source, LocalSource):
        loaded = read_manifest(source)
        if loaded is None:
            return [ChecksumResult(CHECKSUM_MANIFEST, None, None, NO_MANIFEST)]
        manifest, problems = loaded
        if strict_manifest and any(p.status != UNSAFE_PATH for p in problems):
            first = next(p for p in problems if p.status != UNSAFE_PATH)
            raise CheckFailed(f"{first.file}: {first.detail}")
        expected, paths, extra = _local_plan(source, manifest, files)
        extra += problems
        missing = MISSING
    else:
        raise TypeError(f"verify_checksums: unsupported source {type(source).__name__}")
    results = _hash_all(expected, paths, progress, missing)
    return sorted(results + extra, key=lambda r: r.file)


# A digest of all zeros records no hash (a sparse synth has no data to hash): compared only when asked for.
UNRECORDED_DIGEST = "0" * 64


class RecordedHash(NamedTuple):
    """One file's sha256 as a format's own metadata records it, and how a mismatch is reported."""

    file: str  # relative to the checkpoint
    sha256: str
    where: Location  # what a finding about this file points at
    code: str  # the finding code of a mismatch (docs/findings.md)
    message: str  # its message
    size: int | None = None  # the file's bytes, counted as "bytes hashed" where given


def check_recorded(source: Source, recorded: Iterable[RecordedHash], report: Report,
                   progress: ProgressCallback | None = None, known: dict[str, str] | None = None) -> None:
    """Compare each recorded sha256 with its file: one streamed read per file (progress(n) per chunk), none
    for a file whose digest `known` already holds (file -> hex: hashed earlier in this run). A file that
    cannot be read is `file.unreadable` (or the reader's own code), never an exception."""
    for entry in recorded:
        digest = (known or {}).get(entry.file)
        try:
            digest = digest or sha256_file(source.local_path(entry.file), progress)
        except OSError as e:
            report.findings.append(error("file.unreadable", entry.where, f"cannot hash the file ({e.strerror or e})"))
            continue
        except CheckFailed as e:
            report.findings.append(error(e.code or "file.unreadable", entry.where, str(e)))
            continue
        if entry.size is not None:
            report.count("bytes hashed", entry.size)
        if digest != entry.sha256:
            report.findings.append(error(entry.code, entry.where, entry.message, entry.sha256, digest))


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


def read_manifest(source: LocalSource) -> tuple[dict[str, str], list[ChecksumResult]] | None:
    """MANIFEST.sha256 as ({name: sha256}, problems), or None when the checkpoint has none.

    The manifest is opened through the source's path checks: one that is a link leaving the checkpoint is
    refused unread (an `unsafe-path` problem). Each line that cannot be used (not `<64 hex>  <name>`, not
    UTF-8, a name listed twice) is a `malformed` problem naming the line; the other lines still count.
    """
    if CHECKSUM_MANIFEST not in source.list_files():
        return None  # absent (a FIFO of that name is left out of the listing, and validate reports it)
    if source.escapes(CHECKSUM_MANIFEST):
        return {}, [ChecksumResult(CHECKSUM_MANIFEST, None, None, UNSAFE_PATH,
                                   "the manifest is a link that resolves outside the checkpoint: not read")]
    try:
        with open_regular(source.resolve(CHECKSUM_MANIFEST)) as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except (CheckFailed, OSError) as e:
        reason = os_reason(e) if isinstance(e, OSError) else str(e).split(": ", 1)[-1]
        return {}, [ChecksumResult(CHECKSUM_MANIFEST, None, None, UNREADABLE, f"cannot read the file ({reason})")]
    if len(data) > MAX_MANIFEST_BYTES:
        return {}, [ChecksumResult(CHECKSUM_MANIFEST, None, None, UNREADABLE,
                                   f"larger than the {MAX_MANIFEST_BYTES}-byte limit")]
    entries: dict[str, str] = {}
    problems: list[ChecksumResult] = []
    reversed_form: bool | None = None
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw[:-1] if raw.endswith(b"\r") else raw  # sha256sum drops one CR before the newline
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            problems.append(_bad_line(number, "the line is not UTF-8", raw.decode("latin-1")))
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parsed = parse_manifest_line(line, reversed_form)
        if parsed is None:
            problems.append(_bad_line(number, "expected '<64 hex>  <file name>' (as sha256sum writes it)", line))
        elif parsed[1] in entries:
            problems.append(_bad_line(number, f"{text_escape(parsed[1])} is listed twice", line))
        else:
            entries[parsed[1]] = parsed[0].lower()
        reversed_form = parsed[2] if parsed is not None else reversed_form
    return entries, problems


def parse_manifest_line(line: str, reversed_form: bool | None = None) -> tuple[str, str, bool | None] | None:
    """One checksum line (without its newline) as (hex, name, reversed_form) the way `sha256sum -c` reads it,
    None if it refuses it. `reversed_form`: what the lines before decided (None: nothing yet)."""
    match = _MANIFEST_LINE.fullmatch(line)
    if match is not None:
        escaped, digest, rest = match.groups()
        if len(rest) == 1 or rest[:1] not in (" ", "*"):
            if reversed_form is False:
                return None
            reversed_form, name = True, rest
        else:
            name = rest if reversed_form else rest[1:]
            reversed_form = reversed_form or False
    else:
        match = _TAGGED_LINE.fullmatch(line)
        if match is None:
            return None
        escaped, name, digest = match.groups()
    if escaped:
        name = _unescape(name)
    return None if not name else (digest, name, reversed_form)


def _unescape(name: str) -> str | None:
    """sha256sum's escaped names: `\\\\`, `\\n` and `\\r` only; any other backslash makes the line malformed."""
    bad = False

    def one(m: re.Match) -> str:
        nonlocal bad
        bad = bad or m.group(0) not in _UNESCAPES
        return _UNESCAPES.get(m.group(0), "")

    plain = _ESCAPE_SEQUENCE.sub(one, name)
    return None if bad else plain


def manifest_line(digest: str, name: str) -> str:
    """The line sha256sum writes for `name` (names holding a backslash, CR or newline are escaped)."""
    if any(c in name for c in "\\\n\r"):
        name = name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
        return f"\\{digest}  {name}\n"
    return f"{digest}  {name}\n"


def _bad_line(number: int, what: str, line: str) -> ChecksumResult:
    # Named `MANIFEST.sha256:<line>`, the way compilers name a line; the text is escaped, never echoed raw.
    found = text_escape(repr(line[:80]))
    return ChecksumResult(f"{CHECKSUM_MANIFEST}:{number}", None, None, MALFORMED, f"{what}, found {found}")


def _local_plan(source: LocalSource, manifest: dict[str, str], files: Iterable[str] | None):
    wanted = set(files) if files is not None else set(manifest) | set(source.list_files())
    wanted.discard(CHECKSUM_MANIFEST)
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
        try:
            found = git_blob_sha1(path, report) if len(want) == 40 else sha256_file(path, report)
        except OSError as e:
            return ChecksumResult(name, want, None, UNREADABLE, f"cannot read the file ({os_reason(e)})")
        return ChecksumResult(name, want, found, OK if found == want.lower() else MISMATCH)

    with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
        return list(pool.map(check, sorted(expected)))


def sha256_file(path: str | os.PathLike, progress: ProgressCallback | None = None) -> str:
    return _digest(hashlib.sha256(), path, progress)


def write_manifest(directory: str | os.PathLike, names: Iterable[str]) -> Path:
    """Write `MANIFEST.sha256` in `directory` for the named files (`<hex>  <name>` lines, sorted)."""
    directory = Path(directory)
    lines = [manifest_line(sha256_file(directory / name), name) for name in sorted(names)]
    path = directory / CHECKSUM_MANIFEST
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
    with open_regular(path) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            if progress is not None:
                progress(n)
    return digest.hexdigest()
