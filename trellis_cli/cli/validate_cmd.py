"""`trellis validate [SOURCE]`: every rule that applies to the checkpoint's dialect, one verdict, exit 1 on errors."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import (CacheDirOpt, EndpointOpt, OfflineOpt, RevisionOpt, SourceArg, TokenOpt,
                                     open_cli_source)
from trellis_cli.errors import EXIT_FINDINGS, CheckFailed, UnknownDialect
from trellis_cli.findings import Finding, Location, Report, Severity

HELP = (
    "Validate a checkpoint: file safety (header bounds, sizes, offsets, index <-> headers, paths), the "
    "hybrid_tr3_tail contract, bitmap <-> tensor shapes for every (layer, expert, projection, rank), markers, "
    "shared-H rows, tier sizes and tensor counts. Header-only unless --deep or --checksums.\n\n"
    "Each finding has a stable code (docs/findings.md), a location and expected vs found. Exit 1 on any "
    "error (or any warning with --strict).\n\n"
    "The report ends with which serving engines load the checkpoint (docs/engines.md). One engine's rules are "
    "enforced: --engine NAME, or by default the newest rank-sliced vLLM loader for TR3 checkpoints (a plain "
    "exllamav3 checkpoint: exllamav3); the others are reported, not enforced.\n\n"
    "Examples:\n\n"
    "  trellis validate                      # the bundled sample\n\n"
    "  trellis validate ./GLM-TR3 --deep --layers 3-5,40\n\n"
    "  trellis validate org/model --revision main --json\n\n"
    "  trellis validate ./GLM-TR3 --engine vllm-exl3-190"
)
ENGINE_HELP = "Loader profile whose refusals are errors: " + ", ".join(
    ["vllm-exl3-shared-h", "vllm-exl3-190", "b12x-exl3-v1", "exllamav3"]) + " (default: per dialect)."


def register(app: typer.Typer) -> None:
    @app.command("validate", help=HELP)
    def validate_command(
        source: SourceArg = None,
        revision: RevisionOpt = None,
        token: TokenOpt = None,
        offline: OfflineOpt = False,
        endpoint: EndpointOpt = None,
        cache_dir: CacheDirOpt = None,
        layers: Annotated[Optional[str], typer.Option(help="MoE layers for the per-layer rules, e.g. 3-5,40.")] = None,
        deep: Annotated[bool, typer.Option("--deep", help="Also read tensor data of the chosen layers (finite "
                                                          "vectors, marker values, sampled tile decode).")] = False,
        download: Annotated[bool, typer.Option("--download", help="Download the chosen layers' shards into the Hub "
                                                                  "cache (implied by --deep).")] = False,
        checksums: Annotated[bool, typer.Option("--checksums", help="Compare sha256 with the Hub's LFS hashes or "
                                                                    "MANIFEST.sha256.")] = False,
        strict: Annotated[bool, typer.Option("--strict", help="Warnings fail too.")] = False,
        engine: Annotated[Optional[str], typer.Option("--engine", help=ENGINE_HELP)] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Emit the report as one JSON document.")] = False,
    ) -> None:
        from trellis_cli.selection import parse_layer_ranges
        from trellis_cli.validate.engines import engine_named

        if engine is not None:
            engine_named(engine)  # an unknown name is a usage error before anything is read
        chosen = parse_layer_ranges(layers) if layers is not None else None
        opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
        report = _validate(opened, chosen, deep, download, checksums, as_json, engine)
        report.context.setdefault("source", opened.describe())
        failed = not report.ok or (strict and report.warning_count > 0)
        if as_json:
            emit_report_json(report, source=opened.describe(), revision=getattr(opened, "revision", None),
                             strict=strict)
        else:
            render_report(report)
        if failed:
            if not report.ok:  # the FAIL verdict is already on stdout (or in the JSON): said once
                raise typer.Exit(EXIT_FINDINGS)
            raise CheckFailed(f"{report.warning_count} warning(s) with --strict (the verdict above counts errors "
                              f"only)")


def emit_report_json(report: Report, **extra: object) -> None:
    """The report as one JSON document on stdout, every finding in it (streamed: no cap, bounded memory)."""
    document = {**report.to_dict(with_findings=False), **extra}
    output.emit_json(document, streamed=("findings", (f.to_dict() for f in report.every_finding())))


def _validate(opened, layers: list[int] | None, deep: bool, download: bool, checksums: bool,
              as_json: bool, engine: str | None) -> Report:
    from trellis_cli.checkpoint.model import DIALECT_REPACKED
    from trellis_cli.checkpoint.open import open_checkpoint
    from trellis_cli.selection import require_present
    from trellis_cli.validate import run_validation
    from trellis_cli.validate.engines import DEFAULT

    output.log(f"reading {opened.description} ...")
    try:
        with output.stage_progress(enabled=output.progress_enabled(as_json)) as advance:
            checkpoint = open_checkpoint(opened, progress=advance)
    except UnknownDialect as e:
        return _single(opened, "dialect.unknown", str(e))
    except CheckFailed as e:
        return _single(opened, "checkpoint.unreadable", str(e))
    if layers is not None and checkpoint.dialect != DIALECT_REPACKED:  # a route pack's: run_validation's
        require_present(layers, checkpoint.layers)  # before any download or rule
    if deep or download:
        _fetch_layers(checkpoint, layers, as_json)
    with output.stage_progress(enabled=output.progress_enabled(as_json)) as advance:
        progress = advance.progress
        tasks: dict[str, object] = {}

        def hashed(n: int) -> None:
            if "hash" not in tasks:  # every file that can have a recorded hash: a total in human units
                total = sum(size for size in checkpoint.files.values() if size > 0) or None
                tasks["hash"] = progress.add_task("sha256", total=total, bytes=True)
            progress.advance(tasks["hash"], n)

        return run_validation(checkpoint, deep=deep, layers=layers, checksums=checksums,
                              engine=engine or DEFAULT, progress=advance, checksum_progress=hashed)


def _fetch_layers(checkpoint, layers: list[int] | None, as_json: bool) -> None:
    """A Hub source downloads only the shards of the chosen layers before their data is read."""
    from trellis_cli.sources import LocalSource

    if isinstance(checkpoint.source, LocalSource):
        return
    from trellis_cli.selection import fetch_files

    chosen = layers if layers is not None else list(checkpoint.layers)
    files = sorted({f for li in chosen if li in checkpoint.layers for f in checkpoint.layers[li].files})
    if not files:
        return
    output.log(f"downloading {len(files)} shard(s) ...")
    with output.progress_bar("download", None, bytes_mode=True, enabled=output.progress_enabled(as_json)) as advance:
        fetch_files(checkpoint.source, files, progress=advance)


def _single(opened, code: str, message: str) -> Report:
    from trellis_cli.validate.engines import unreadable_verdicts

    report = Report(subject=opened.description, context={"source": opened.describe()})
    report.findings.append(Finding(code, Severity.ERROR, Location(), message))
    report.engines = unreadable_verdicts("not a checkpoint it reads" if code == "dialect.unknown" else "unreadable")
    return report


_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def render_report(report: Report) -> None:
    """Findings (errors first), how many more of each capped code, the one-line verdict, then which engines load
    the checkpoint, on stdout."""
    from trellis_cli.validate.engines import compatibility_line

    order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
    lines = [(f.severity, f.line()) for f in report.findings] + report.omitted_lines()
    for severity, line in sorted(lines, key=lambda item: order[item[0]]):
        output.print_line(line, style=_STYLE[severity])
    context = report.context
    if context.get("dialect"):
        output.print_line(f"dialect: {context['dialect']}")
    if context.get("engine"):
        enforced = next((v for v in report.engines if v["enforced"]), {})
        how = "default" if enforced.get("default") else "--engine"
        output.print_line(f"engine rules enforced: {context['engine']} ({how})")
    elif "engine" in context:
        output.print_line("engine rules enforced: none (no profiled loader reads this dialect; --engine NAME "
                          "enforces one)")
    output.print_line(report.summary(), style="bold green" if report.ok else "bold red")
    if report.engines:
        output.print_line(compatibility_line(report.engines, context.get("markers") != "not read"))
