"""`validate_source`: one validation from a source to its Report, the one call behind `trellis validate`.

Opening is part of it: a directory no dialect claims is the finding `dialect.unknown`, one that cannot be read
`checkpoint.unreadable`, each with every engine's verdict (none loads it), so the library and the CLI give the
same report for the same request. The default engine is the dialect's (validate/engines.py DEFAULT).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trellis_cli.errors import CheckFailed, UnknownDialect
from trellis_cli.findings import Finding, Location, Report, Severity
from trellis_cli.validate import engines, run_validation
from trellis_cli.sources import SourceArg


@dataclass(frozen=True)
class ValidateRequest:
    layers: list[int] | None = None  # the per-layer rules' selection (selection.parse_layer_ranges)
    deep: bool = False  # read tensor data of the chosen layers
    checksums: bool = False  # compare sha256 with the Hub's LFS hashes or MANIFEST.sha256
    download: bool = False  # fetch the chosen layers' shards of a Hub source (implied by deep)
    engine: str | None = engines.DEFAULT  # the profile to enforce; None: the format rules alone
    tp: int | None = None  # the TP the server will run, checked against every profile's TP contract
    strict: bool = False  # warnings fail too

    def __post_init__(self) -> None:
        from trellis_cli.selection import require_count

        require_count(self.tp, "tp")  # refused when the request is made, before anything is read


@dataclass
class ValidateProgress:
    """Where a long validation reports: rule stages, bytes hashed, bytes downloaded, and what it is doing."""

    stage: Callable[[str, int, int], None] | None = None
    hashed: Callable[[int], None] | None = None
    downloaded: Callable[[int], None] | None = None
    log: Callable[[str], None] | None = None
    hash_total: Callable[[int | None], None] | None = None  # before hashing: every file's bytes, when known


def validate_source(source: SourceArg, request: ValidateRequest | None = None,
                    progress: ValidateProgress | None = None) -> Report:
    """Open `source` (a Source or a local path) and validate it as `request` says. Raises only for a usage
    error (an unknown engine, a layer the checkpoint lacks); everything wrong with the checkpoint is a finding."""
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.dialects.open import require_source
    from trellis_cli.dialects.registry import dialect_of
    from trellis_cli.selection import require_present

    source = require_source(source)
    request = request or ValidateRequest()
    progress = progress or ValidateProgress()
    if request.engine not in (None, engines.DEFAULT):
        engines.engine_named(request.engine)  # an unknown name is a usage error before anything is read
    if progress.log is not None:
        progress.log(f"reading {source if isinstance(source, (str, Path)) else source.description} ...")
    try:
        checkpoint = open_checkpoint(source, progress=progress.stage)
    except UnknownDialect as e:
        return unopened(source, "dialect.unknown", str(e), request.strict)
    except CheckFailed as e:
        return unopened(source, "checkpoint.unreadable", str(e), request.strict)
    if request.layers is not None:  # before any download or rule
        require_present(request.layers, dialect_of(checkpoint).declared_layers(checkpoint))
    if request.deep or request.download:
        _fetch_layers(checkpoint, request.layers, progress)
    if progress.hash_total is not None:  # every file that can have a recorded hash
        progress.hash_total(sum(size for size in checkpoint.files.values() if size > 0) or None)
    report = run_validation(checkpoint, deep=request.deep, layers=request.layers, checksums=request.checksums,
                            engine=request.engine, tp=request.tp, progress=progress.stage, checksum_progress=progress.hashed)
    report.strict = request.strict
    return report


def unopened(source: SourceArg, code: str, message: str, strict: bool = False) -> Report:
    """The report of a checkpoint that could not be opened: one error, and no engine loads it."""
    if isinstance(source, (str, Path)):
        report = Report(subject=str(source), context={"source": str(source)}, strict=strict)
    else:
        report = Report(subject=source.description, context={"source": source.describe()}, strict=strict)
    report.findings.append(Finding(code, Severity.ERROR, Location(), message))
    report.engines = engines.unreadable_verdicts("not a checkpoint it reads" if code == "dialect.unknown"
                                                 else "unreadable")
    return report


def _fetch_layers(checkpoint, layers: list[int] | None, progress: ValidateProgress) -> None:
    """A Hub source downloads only the shards of the chosen layers before their data is read."""
    from trellis_cli.sources import LocalSource

    if isinstance(checkpoint.source, LocalSource):
        return
    from trellis_cli.selection import fetch_files

    chosen = layers if layers is not None else list(checkpoint.layers)
    files = sorted({f for li in chosen if li in checkpoint.layers for f in checkpoint.layers[li].files})
    if not files:
        return
    if progress.log is not None:
        progress.log(f"downloading {len(files)} shard(s) ...")
    fetch_files(checkpoint.source, files, progress=progress.downloaded)
