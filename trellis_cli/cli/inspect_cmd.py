"""`trellis inspect [SOURCE]`: what a checkpoint is, from headers only (per-layer partitions, bytes, tiers)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import (CacheDirOpt, EndpointOpt, OfflineOpt, RevisionOpt, SourceArg, TokenOpt,
                                     open_cli_source, parse_layers)
from trellis_cli.errors import CheckFailed, UsageError

HELP = (
    "Describe a checkpoint without reading tensor data: dialect, geometry, per MoE layer the K partition "
    "(e.g. 192/64), bpw, bytes per rank, tier membership as id ranges, rotation layout and shards, with runs "
    "of identical layers collapsed; totals per rank and for the whole checkpoint.\n\n"
    "Examples:\n\n"
    "  trellis inspect                       # the bundled sample\n\n"
    "  trellis inspect org/model --revision main --markdown\n\n"
    "  trellis inspect ./GLM-TR3 --layers 3 --json"
)


def inspect_command(
    source: SourceArg = None,
    revision: RevisionOpt = None,
    token: TokenOpt = None,
    offline: OfflineOpt = False,
    endpoint: EndpointOpt = None,
    cache_dir: CacheDirOpt = None,
    layers: Annotated[Optional[str], typer.Option(help="Only these MoE layers, e.g. 3-5,40.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Emit one JSON document.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Emit a Markdown table.")] = False,
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, help="The TP the server will run: K per "
                                              "projection and routed bytes per rank at that TP, and which "
                                              "engines accept it; with --gpu or --gpu-mem also the "
                                              "`trellis fit` section at this TP.")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU preset for the fit section.")] = None,
    gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", help="GPU memory for the fit section "
                                                   "(with --arch).")] = None,
    arch: Annotated[Optional[str], typer.Option("--arch", help="GPU family for the fit section with --gpu-mem: "
                                                "sm_90, sm_100 or sm_120.")] = None,
    ctx: Annotated[Optional[int], typer.Option("--ctx", help="Context length for the fit section.")] = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor (file, name, dtype, shape, "
                                                           "bytes; K and bpw of EXL3 codes), with per-layer and "
                                                           "whole totals; --markdown: one table per layer.")] = False,
) -> None:
    from trellis_cli.inspect_request import InspectProgress, InspectRequest, inspect_source

    if as_json and markdown:
        raise UsageError("--json and --markdown are exclusive: choose one output format")
    fit_gpu = _fit_gpu(tp, gpu, gpu_mem, arch)
    request = InspectRequest(layers=parse_layers(layers), tensors=tensors, tp=tp, gpu=fit_gpu, ctx=ctx)
    opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
    # A production checkpoint has ~80 shards and 930k tensors: on a terminal, a bar per stage with its count.
    with output.stage_progress(enabled=output.progress_enabled(as_json)) as advance:
        document = inspect_source(opened, request, InspectProgress(stage=advance, log=output.log))
    if as_json:
        head, streamed = document.json_parts()  # a tensor listing's rows written one by one
        output.emit_json(head, streamed=streamed)
    elif document.tensors is not None:
        _print_tensors(document.tensors, markdown)
    else:
        _print_summary(document, markdown)
    if document.unreadable:
        first = document.unreadable[0]
        raise CheckFailed(f"{len(document.unreadable)} file header(s) could not be read, first "
                          f"{first['file']}: {first['error']}")


def _fit_gpu(tp: int | None, gpu: str | None, gpu_mem: str | None, arch: str | None = None):
    """The fit section's GPU from --gpu / --gpu-mem (None without either); asking for it without --tp is a
    usage error before the GPU name is looked up."""
    if gpu is None and gpu_mem is None:
        return None
    if tp is None:
        from trellis_cli.inspect_request import FIT_NEEDS

        raise UsageError(FIT_NEEDS)
    from trellis_cli.fit.gpus import choose_gpu

    return choose_gpu(gpu, gpu_mem, arch)


def _print_summary(document, markdown: bool) -> None:
    from trellis_cli.inspect_report import human_bytes, render_markdown, render_text
    from trellis_cli.inspect_tp import render_tp_view

    lines = render_markdown(document.summary) if markdown else render_text(document.summary)
    if document.serve_tp is not None:
        lines = [*lines, "", *render_tp_view(document.serve_tp, human_bytes)]
    for line in lines:
        output.print_line(line)
    if document.fit is not None:
        from trellis_cli.cli.fit_render import render

        output.print_line("")
        render(document.fit, document.description, document.dialect)


def _print_tensors(listing, markdown: bool) -> None:
    from trellis_cli import inspect_tensors

    render = inspect_tensors.render_markdown if markdown else inspect_tensors.render_text
    for line in render(listing):
        output.print_line(line)
