"""`trellis validate [SOURCE]`: every rule that applies to the checkpoint's dialect, one verdict, exit 1 on errors."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import (CacheDirOpt, EndpointOpt, OfflineOpt, RevisionOpt, SourceArg, TokenOpt,
                                     engine_option, open_cli_source, parse_layers)
from trellis_cli.errors import EXIT_FINDINGS, CheckFailed
from trellis_cli.findings import Report, Severity

HELP = (
    "Validate a checkpoint of any dialect trellis reads (TR3, R7, plain exllamav3, exl3-v1, BTX, a b12x_trellis "
    "block, a route pack, a GLM-5.3 unsliced stream; the report names it): file safety for every one (header "
    "bounds, sizes, offsets, index <-> headers, paths), then the dialect's own rules: for TR3 the hybrid_tr3_tail "
    "contract, bitmap <-> tensor shapes for every (layer, expert, projection, rank), markers, shared-H rows, tier "
    "sizes and tensor counts; for R7 its per-projection K maps; for plain exllamav3 its tensor_storage records; for "
    "exl3-v1 and BTX the checks b12x's reader makes of the slot-major container; for a b12x_trellis block its "
    "TrellisConfig and rate tensor; for a route pack every layer file against its manifest; for the GLM-5.3 stream "
    "its scope and schema. Header-only unless --deep or --checksums.\n\n"
    "Each finding has a stable code (docs/findings.md), a location and expected vs found. Exit 1 on any "
    "error (or any warning with --strict).\n\n"
    "The report ends with which serving engines load the checkpoint (docs/engines.md). One engine's rules are "
    "enforced: --engine NAME, or by default the dialect's own (TR3: the newest rank-sliced vLLM loader; R7 and the "
    "GLM-5.3 stream: vllm-exl3-r7; exl3-v1 and a b12x_trellis block: b12x-exl3-v1; BTX: b12x-1.3.0; plain "
    "exllamav3: exllamav3; a route pack, which no engine loads: none); the others are reported, not enforced.\n\n"
    "Examples:\n\n"
    "  trellis validate                      # the bundled sample\n\n"
    "  trellis validate ./GLM-TR3 --deep --layers 3-5,40\n\n"
    "  trellis validate org/model --revision main --json\n\n"
    "  trellis validate ./GLM-TR3 --engine vllm-exl3-190\n\n"
    "  trellis validate ./GLM-R7 --engine vllm-exl3-r7 --tp 8"
)
ENGINE_HELP = "Loader profile whose refusals are errors: " + ", ".join(
    ["vllm-exl3-shared-h", "vllm-exl3-190", "vllm-exl3-r7", "vllm-exl3-manifest", "b12x-exl3-v1", "b12x-1.3.0",
     "exllamav3", "vllm-exl3-pr766"]
) + " (default: per dialect)."
TP_HELP = ("The tensor-parallel degree the server will run: checked against each engine's TP contract (a "
           "rank-sliced checkpoint's recorded tp, 128-aligned slices, the exl3-manifest extent plan); on exl3-v1 it also "
           "shows how b12x's partition_extents and the fork's plan_exl3_extent cut the slots. Without it "
           "the report lists the TP degrees each engine would accept.")


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
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, help=TP_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Emit the report as one JSON document.")] = False,
) -> None:
    from trellis_cli.validate.request import ValidateRequest, validate_source

    request = ValidateRequest(layers=parse_layers(layers), deep=deep, checksums=checksums, download=download,
                              engine=engine_option(engine), tp=tp, strict=strict)
    opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
    with output.make_progress(enabled=output.progress_enabled(as_json)) as bars:
        report = validate_source(opened, request, _progress(bars, as_json))
    report.context.setdefault("source", opened.describe())
    if as_json:
        emit_report_json(report, source=opened.describe(), revision=opened.revision,
                         strict=strict)
    else:
        render_report(report)
    if not report.ok:
        if report.error_count:  # the FAIL verdict is already on stdout (or in the JSON): said once
            raise typer.Exit(EXIT_FINDINGS)
        raise CheckFailed(f"{report.warning_count} warning(s) with --strict (the verdict above counts errors "
                          f"only)")


def emit_report_json(report: Report, **extra: object) -> None:
    """The report as one JSON document on stdout, every finding in it (streamed: no cap, bounded memory)."""
    document = {**report.to_dict(with_findings=False), **extra}
    output.emit_json(document, streamed=("findings", (f.to_dict() for f in report.every_finding())))


def _progress(bars, as_json: bool):
    """Progress callbacks for validate_source: one bar per rule stage, one for sha256, one for downloads."""
    from trellis_cli.validate.request import ValidateProgress

    tasks: dict[str, object] = {}
    stage = output.stage_advancer(bars)  # opening (files read, model built), then the rules, one bar each
    totals: dict[str, int | None] = {}

    def counter(name: str, description: str):
        def advance(n: int) -> None:
            if name not in tasks:  # a total in human units where one is known
                tasks[name] = bars.add_task(description, total=totals.get(name), bytes=True)
            bars.advance(tasks[name], n)
        return advance

    return ValidateProgress(stage=stage, hashed=counter("hash", "sha256"), downloaded=counter("download", "download"),
                            log=output.log, hash_total=lambda n: totals.__setitem__("hash", n))


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
        enforced = next((v for v in report.engines if v["enforced"]), None)
        how = "default" if enforced is not None and enforced["default"] else "--engine"
        output.print_line(f"engine rules enforced: {context['engine']} ({how})")
    elif "engine" in context:
        output.print_line("engine rules enforced: none (no profiled loader reads this dialect; --engine NAME "
                          "enforces one)")
    if context.get("tp_partitions"):
        for line in partition_lines(context["tp_partitions"], context["tp"]):
            output.print_line(line)
    output.print_line(report.summary(), style="bold green" if report.ok else "bold red")
    if report.engines:
        output.print_line(compatibility_line(report.engines, context.get("markers") != "not read", context.get("tp")))


def partition_lines(parts: list[dict[str, Any]], tp: int) -> list[str]:
    """The human view of a dialect's `tp_partitions` (each planner's rank extents at the server TP)."""
    from trellis_cli.id_ranges import compact_ranges

    lines = []
    for part in parts:
        head = f"TP {tp} extents by {part['planner']} ({part['version']})"
        if part["refused"]:
            lines.append(f"{head}: refused: {part['refused']}")
        elif not part["per_layer"]:
            lines.append(f"{head}, every layer: " + _shown(part["extents"]))
        else:
            layers = part["layers"]
            first = next(iter(layers))
            agree = compact_ranges(part["same_as_b12x"]) if part["same_as_b12x"] else "none"
            lines.append(f"{head}, rotating per layer: layer {first} " + _shown(layers[first])
                         + f"; layers where it equals b12x's: {agree}")
    return lines


def _shown(extents: list[list[int]]) -> str:
    return " ".join(f"r{r}=[{a},{a + n})" for r, (a, n) in enumerate(extents))
