"""Validation: run every rule that applies to a checkpoint's dialect and collect the findings in one Report.

Rules live in one module per family: rules_files (byte layout, index, paths), rules_config (metadata
contracts), rules_tensors (header facts per linear and per layer), rules_runtime (traps after a clean load),
rules_markers (codebook marker values, read by default for local sources), rules_data (--deep: tensor
values), and last the loader profiles of engines.py (the enforced one's refusals, every one's verdict).
Which rules apply is the dialect's answer (dialects/registry.py), never a comparison of names: the shard
rules where the dialect stores per-linear shards, the dialect's own rules (`Dialect.check`: an exl3-v1's
reader checks, a route pack's verification against its manifest), then for every dialect the shared data
rules over the normalized model (--deep), the recorded hashes (checksums.py, one rule for every dialect), and every engine profile's verdict.
Every rule runs even after errors, so one run shows every problem. Rules never raise on bad input; they yield
findings. `validate_source` (request.py) is the one call behind `trellis validate`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from trellis_cli.checkpoint import heap, layer_columns
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import CheckRequest, Dialect
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import MAX_FINDINGS_PER_CODE, Finding, Location, Report, Severity, finding_order
from trellis_cli.id_ranges import compact_ranges
from trellis_cli.validate import (engine_weights, engines, rules_config, rules_files, rules_markers, rules_names, rules_runtime,
                                  rules_tensors)
from trellis_cli.validate import checksums as checksum_rule

Progress = Callable[[str, int, int], None] | None  # (stage, done, total) as layers complete

# Said beside every verdict that did not read tensor values: a header-perfect checkpoint of zeros passes.
NOT_DEEP_NOTE = "tensor data not checked (headers only; --deep reads it)"
def run_validation(checkpoint: Checkpoint, *, deep: bool = False, layers: list[int] | None = None,
                   checksums: bool = False, engine: str | None = engines.DEFAULT, tp: int | None = None,
                   progress: Callable[[str, int, int], None] | None = None,
                   checksum_progress: Callable[[int], None] | None = None) -> Report:
    """Validate `checkpoint`; `layers` limits the per-layer rules (file and config rules always run).

    `engine` names the loader profile to enforce (validate/engines.py): `engines.DEFAULT`, the default, enforces
    the dialect's own choice (what `trellis validate` does without --engine); None enforces none (the format
    rules alone decide, as for repack's check of its source); either way every profile's verdict is in
    `report.engines` and `report.context["engine"]` says which one was enforced. `tp`: the TP the server will
    run (--tp), checked against every profile's TP contract (validate/engine_tp.py); without it each verdict lists
    the TP degrees its profile accepts.
    `progress(stage, done, total)` is called as layers complete; `checksum_progress(n)` with bytes hashed.
    """
    from trellis_cli.selection import require_count

    require_count(tp, "tp")
    # the rules read every layer's linears, and the engine profiles the model weights, several times
    with heap.settled(), layer_columns.shared(), engine_weights.shared():
        return _validate(checkpoint, deep, layers, checksums, engine, tp, progress, checksum_progress)


def _validate(checkpoint: Checkpoint, deep: bool, layers: list[int] | None, checksums: bool, engine: str | None,
              tp: int | None, progress: Progress, checksum_progress: Callable[[int], None] | None) -> Report:
    from trellis_cli.dialects.open import paused_gc

    dialect = dialect_of(checkpoint)
    enforced = engines.enforced_name(engine, checkpoint.dialect)
    selected = _selected_layers(checkpoint, dialect, layers)  # a usage error before any rule runs
    report = Report(subject=_subject(checkpoint), context=_context(checkpoint))
    digests = checksum_rule.publisher_first(checkpoint, dialect, checksums, report, checksum_progress)
    request = CheckRequest(selected, deep, checksums, narrowed=layers is not None, progress=progress,
                           checksum_progress=checksum_progress, known_digests=digests)
    report.extend(rules_names.check_names(checkpoint, dialect))
    if dialect.shard_rules:
        with paused_gc():
            _run_header_rules(checkpoint, selected, report, progress)
        _run_markers(checkpoint, selected, report, deep)
    dialect.check(checkpoint, request, report)
    checksum_rule.compare_recorded(checkpoint, dialect, request, report)
    if dialect.tensor_data:
        if deep:
            _run_deep(checkpoint, dialect, selected, report, progress)
        else:
            report.notes.append(NOT_DEEP_NOTE)
    checksum_rule.after_rules(checkpoint, dialect, checksums, report, checksum_progress)
    report.extend(engine_weights.notes(checkpoint))
    engines.assess(checkpoint, selected, report, enforced, tp)
    partitions = dialect.tp_partitions(checkpoint, tp) if tp is not None else None
    if partitions is not None:  # which slots each rank reads, by each planner (they differ)
        report.context["tp_partitions"] = partitions
    note = engine_weights.synth_note(checkpoint, any(r["code"] == engine_weights.MISSING
                                                     for v in report.engines for r in v["reasons"]))
    if note:
        report.notes.append(note)
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
    report.count("linears", sum(len(layer_columns.columns(checkpoint.layers[li]).linears) for li in selected))


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
    return ckpt.source.description or str(ckpt.source)


def _context(ckpt: Checkpoint) -> dict[str, Any]:
    return {"source": ckpt.source.describe(), "dialect": ckpt.dialect,
            "rotation_layout": ckpt.rotation_layout, "tp": ckpt.tp, "revision": ckpt.source.revision}


def _selected_layers(ckpt: Checkpoint, dialect: Dialect, layers: list[int] | None) -> list[int]:
    """The layers the per-layer rules read: naming one the checkpoint lacks is a mistake, whatever the dialect."""
    if layers is None:
        return list(ckpt.layers)
    from trellis_cli.selection import require_present

    return require_present(layers, dialect.declared_layers(ckpt))


def _run_deep(ckpt: Checkpoint, dialect: Dialect, selected: list[int], report: Report, progress: Progress) -> None:
    """The data rules: every dialect's hidden-side vectors (NaN/Inf, all zero, subnormal), as its normalized
    model lists them; then, for per-linear shards, the sampled tile decode and the shareable-rows check."""
    from trellis_cli.validate import rules_data

    for done, li in enumerate(selected, 1):
        report.extend(rules_data.check_vectors(ckpt, dialect.vectors(ckpt, li), report.count))
        if dialect.shard_rules:
            report.extend(rules_data.check_layer_tiles(ckpt, ckpt.layers[li], report.count))
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
    root = ckpt.source.root
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
