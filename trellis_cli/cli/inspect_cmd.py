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


def register(app: typer.Typer) -> None:
    @app.command("inspect", help=HELP)
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
        gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", help="GPU memory for the fit section.")] = None,
        ctx: Annotated[Optional[int], typer.Option("--ctx", help="Context length for the fit section.")] = None,
        tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor (file, name, dtype, shape, "
                                                               "bytes; K and bpw of EXL3 codes), with per-layer and "
                                                               "whole totals; --markdown: one table per layer.")] = False,
    ) -> None:
        from trellis_cli.dialects import open_checkpoint
        from trellis_cli.inspect_report import build_inspect, render_markdown, render_text
        from trellis_cli.workflows import serve_tp_view

        if as_json and markdown:
            raise UsageError("--json and --markdown are exclusive: choose one output format")
        fit_request = _fit_request(tp, gpu, gpu_mem, ctx)
        chosen = parse_layers(layers)
        opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
        output.log(f"reading headers of {opened.description} ...")
        # A production checkpoint has ~80 shards and 930k tensors: on a terminal, a bar per stage with its count.
        with output.stage_progress(enabled=output.progress_enabled(as_json)) as advance:
            checkpoint = open_checkpoint(opened, progress=advance)
            if tensors:
                _list_tensors(checkpoint, chosen, as_json, markdown)
                return
            document = build_inspect(checkpoint, chosen)
            if tp is not None:
                document["serve_tp"] = serve_tp_view(checkpoint, chosen, tp)
            fitted = None
            if fit_request is not None:
                from trellis_cli.fit.run import fit

                fitted = fit(checkpoint, fit_request)
        if as_json:
            if fitted is not None:
                document["fit"] = fitted.to_json()
            output.emit_json(document)
            return
        lines = render_markdown(document) if markdown else render_text(document)
        if tp is not None:
            from trellis_cli.inspect_report import human_bytes
            from trellis_cli.inspect_tp import render_tp_view

            lines = [*lines, "", *render_tp_view(document["serve_tp"], human_bytes)]
        for line in lines:
            output.print_line(line)
        if fitted is not None:
            from trellis_cli.cli.fit_render import render

            output.print_line("")
            render(fitted, opened.description, checkpoint.dialect)


def _fit_request(tp: int | None, gpu: str | None, gpu_mem: str | None, ctx: int | None):
    """The fit section's request when --tp and a GPU are given; a usage error when only one half is."""
    if gpu is None and gpu_mem is None and ctx is None:
        return None  # --tp alone: the server TP's view, no fit section
    if tp is None or (gpu is None and gpu_mem is None):
        raise UsageError("the fit section of inspect needs --tp N and --gpu NAME or --gpu-mem SIZE")
    from trellis_cli.fit.gpus import choose_gpu
    from trellis_cli.fit.run import FitRequest, check_request

    request = FitRequest(tp=tp, gpu=choose_gpu(gpu, gpu_mem), ctx=ctx)
    check_request(request)
    return request


def _list_tensors(checkpoint, chosen: list[int] | None, as_json: bool, markdown: bool) -> None:
    from trellis_cli import inspect_tensors

    document = inspect_tensors.build_tensor_listing(checkpoint, chosen)
    if as_json:
        output.emit_json(document)
    else:
        render = inspect_tensors.render_markdown if markdown else inspect_tensors.render_text
        for line in render(document):
            output.print_line(line)
    if document["unreadable"]:
        raise CheckFailed(f"{len(document['unreadable'])} file header(s) could not be read, first "
                          f"{document['unreadable'][0]['file']}: {document['unreadable'][0]['error']}")
