"""Validation: run every rule that applies to a checkpoint's dialect and collect the findings in one Report.

Rules live in one module per family: rules_files (byte layout, index, paths), rules_config (metadata
contracts), rules_tensors (header facts per linear and per layer), rules_runtime (traps after a clean load),
rules_markers (codebook marker values, read by default for local sources), rules_data (--deep: tensor
values), and last the loader profiles of engines.py (the enforced one's refusals, every one's verdict).
Every rule runs even after errors, so one run shows every problem. A repacked directory is checked by the
route-pack verifier instead. Rules never raise on bad input; they yield findings.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from trellis_cli.checkpoint.model import DIALECT_EXL3V1, DIALECT_REPACKED, Checkpoint
from trellis_cli.findings import MAX_FINDINGS_PER_CODE, Finding, Location, Report, Severity, finding_order
from trellis_cli.id_ranges import compact_ranges
from trellis_cli.validate import (engines, rules_config, rules_files, rules_markers, rules_runtime,
                                  rules_tensors)

Progress = Callable[[str, int, int], None] | None  # (stage, done, total) as layers complete

# Said beside every verdict that did not read tensor values: a header-perfect checkpoint of zeros passes.
NOT_DEEP_NOTE = "tensor data not checked (headers only; --deep reads it)"
ROUTE_PACK_NOTE = ("tensor values not checked: the sha256 of every file matches the manifest repack wrote "
                   "(validate the source with --deep to check its data)")

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


def run_validation(checkpoint: Checkpoint, *, deep: bool = False, layers: list[int] | None = None,
                   checksums: bool = False, engine: str | None = None,
                   progress: Callable[[str, int, int], None] | None = None,
                   checksum_progress: Callable[[int], None] | None = None) -> Report:
    """Validate `checkpoint`; `layers` limits the per-layer rules (file and config rules always run).

    `engine` names the loader profile to enforce (validate/engines.py): `engines.DEFAULT` (what the CLI passes
    without --engine) enforces the dialect's default; None enforces none (the format rules alone decide, as for
    repack's check of its source); either way every profile's verdict is in `report.engines`.
    `progress(stage, done, total)` is called as layers complete; `checksum_progress(n)` with bytes hashed.
    """
    enforced = engines.enforced_name(engine, checkpoint.dialect)
    if checkpoint.dialect == DIALECT_REPACKED:
        report = _validate_route_pack(checkpoint, layers, checksum_progress)
        engines.assess(checkpoint, [], report, enforced)
        cap_findings(report)
        return report
    from trellis_cli.checkpoint.open import paused_gc

    selected = _selected_layers(checkpoint, layers)  # a usage error before any rule runs
    report = Report(subject=_subject(checkpoint), context=_context(checkpoint))
    if checkpoint.dialect == DIALECT_EXL3V1:
        from trellis_cli.validate.rules_exl3v1 import check_exl3v1

        check_exl3v1(checkpoint, report, selected, deep=deep, checksums=checksums, progress=progress,
                     checksum_progress=checksum_progress)
        cap_findings(report)
        return report
    with paused_gc():
        _run_header_rules(checkpoint, selected, report, progress)
    _run_markers(checkpoint, selected, report, deep)
    if deep:
        _run_deep(checkpoint, selected, report, progress)
    else:
        report.notes.append(NOT_DEEP_NOTE)
    if checksums:
        _run_checksums(checkpoint, report, checksum_progress)
    engines.assess(checkpoint, selected, report, enforced)
    report.context["engine"] = enforced
    cap_findings(report)
    return report


def _run_header_rules(checkpoint: Checkpoint, selected: list[int], report: Report, progress: Progress) -> None:
    report.extend(checkpoint.parse_findings)
    report.extend(rules_files.check_files(checkpoint))
    report.count("files", len(checkpoint.headers))
    report.count("tensors", len(checkpoint.tensors))
    report.extend(rules_config.check_config(checkpoint))
    if not checkpoint.layers:
        report.findings.append(Finding("layer.none", Severity.WARNING, Location(), "no routed-expert MoE layers "
                                       "found: nothing for the per-layer rules to check"))
    for done, li in enumerate(selected, 1):
        report.extend(rules_tensors.check_layers(checkpoint, [li]))
        if progress is not None:
            progress("headers", done, len(selected))
    report.extend(rules_runtime.check_runtime(checkpoint, selected))
    report.count("layers", len(selected))
    report.count("linears", sum(len(r) for li in selected for p in checkpoint.layers[li].experts.values()
                                for r in p.values()))


def _run_markers(ckpt: Checkpoint, selected: list[int], report: Report, deep: bool) -> None:
    """Marker values are read by default where the bytes are local; a remote source reads them with --deep."""
    from trellis_cli.sources import LocalSource

    if deep or isinstance(ckpt.source, LocalSource):
        report.extend(rules_markers.check_marker_values(ckpt, selected, report.count))
        report.context["markers"] = "read"
    else:
        report.findings.append(rules_markers.not_read_finding())
        report.context["markers"] = "not read"


def _subject(ckpt: Checkpoint) -> str:
    return getattr(ckpt.source, "description", None) or str(ckpt.source)


def _context(ckpt: Checkpoint) -> dict[str, Any]:
    describe = getattr(ckpt.source, "describe", None)
    return {"source": describe() if describe else str(ckpt.source), "dialect": ckpt.dialect,
            "rotation_layout": ckpt.rotation_layout, "tp": ckpt.tp, "revision": getattr(ckpt.source, "revision", None)}


def _selected_layers(ckpt: Checkpoint, layers: list[int] | None) -> list[int]:
    if layers is None:
        return list(ckpt.layers)
    from trellis_cli.selection import require_present

    return require_present(layers, ckpt.layers)


def _run_deep(ckpt: Checkpoint, selected: list[int], report: Report, progress: Progress) -> None:
    from trellis_cli.validate import rules_data

    for done, li in enumerate(selected, 1):
        report.extend(rules_data.check_layer_data(ckpt, ckpt.layers[li], report.count))
        if progress is not None:
            progress("data", done, len(selected))
    report.context["deep_layers"] = compact_ranges(selected)
    if any(f.code == "data.zero-vector" for f in report.findings) and _sparse_synthetic(ckpt, selected):
        report.notes.append(SPARSE_SYNTH_NOTE)


SPARSE_SYNTH_NOTE = ("the data.zero-vector errors are expected here: `trellis synth --sparse` wrote this checkpoint "
                     "with headers only, and its unwritten data reads as zeros (synth without --sparse writes data "
                     "that --deep passes)")


def _sparse_synthetic(ckpt: Checkpoint, selected: list[int]) -> bool:
    """Written by `trellis synth` (its config says so) with files whose data was never written (holes)."""
    tail = ckpt.config.get("hybrid_tr3_tail") if isinstance(ckpt.config, dict) else None
    root = getattr(ckpt.source, "root", None)
    if not isinstance(tail, dict) or tail.get("producer_version") != "trellis synth" or root is None:
        return False
    import os

    for name in sorted({f for li in selected for f in ckpt.layers[li].files}):
        try:
            stat = os.stat(os.path.join(root, name))
        except OSError:
            return False
        if getattr(stat, "st_blocks", None) is None or stat.st_blocks * 512 >= stat.st_size // 2:
            return False  # allocated: real data, not holes
    return True


def _run_checksums(ckpt: Checkpoint, report: Report, progress: Callable[[int], None] | None) -> None:
    from trellis_cli.integrity import verify_checksums

    results = verify_checksums(ckpt.source, progress=progress, strict_manifest=False)
    report.count("checksums", sum(r.ok for r in results))
    for r in results:
        if r.ok:
            continue
        code, severity, message = CHECKSUM_CODES.get(r.status, ("checksum.mismatch", Severity.ERROR, r.status))
        report.findings.append(Finding(code, severity, Location(file=r.file), r.detail or message,
                                       expected=r.expected, found=r.found))


def _validate_route_pack(ckpt: Checkpoint, layers: list[int] | None,
                         progress: Callable[[int], None] | None) -> Report:
    from trellis_cli.routepack.manifest import declared_layers
    from trellis_cli.routepack.verify import verify_repacked
    from trellis_cli.selection import require_present

    if layers is not None:  # the same meaning as for a checkpoint: naming a layer the pack lacks is a mistake
        require_present(layers, declared_layers(ckpt.declared.get("manifest")))
    # A route pack's manifest records the sha256 of every file it wrote, and hashing is the only check that
    # sees a flipped byte inside tensor data: always done, --checksums or not (one read of the output).
    report = verify_repacked(ckpt.source, check_hashes=True, progress=progress)
    report.context.setdefault("dialect", DIALECT_REPACKED)
    report.notes.append(ROUTE_PACK_NOTE)
    if layers is not None:
        report.notes.append("--layers does not narrow a route pack's checks: every file is checked against its "
                            "manifest")
    return report


def cap_findings(report: Report, limit: int = MAX_FINDINGS_PER_CODE) -> None:
    """Order the findings (`finding_order`: numbers as numbers), list the first `limit` of each code and move
    the rest to `report.unlisted`, counted in `report.omitted` (the totals stay true; JSON carries them all).

    Summaries the rules already made (one per layer, carrying their own count) are always listed.
    """
    seen: Counter[str] = Counter()
    kept: list[Finding] = []
    for f in sorted(report.findings, key=finding_order):
        if f.summary:
            kept.append(f)
            continue
        seen[f.code] += 1
        if seen[f.code] <= limit:
            kept.append(f)
        else:
            key = (f.code, f.severity)
            report.omitted[key] = report.omitted.get(key, 0) + f.count
            report.unlisted.append(f)
    report.findings = kept
