"""`trellis inspect [SOURCE]`: what a checkpoint is, from headers only (per-layer partitions, bytes, tiers)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import (CacheDirOpt, EndpointOpt, OfflineOpt, RevisionOpt, SourceArg, TokenOpt,
                                     open_cli_source)
from trellis_cli.errors import UsageError

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
    ) -> None:
        from trellis_cli.checkpoint.open import open_checkpoint
        from trellis_cli.inspect_report import build_inspect, render_markdown, render_text
        from trellis_cli.selection import parse_layer_ranges

        if as_json and markdown:
            raise UsageError("--json and --markdown are exclusive: choose one output format")
        chosen = parse_layer_ranges(layers) if layers is not None else None
        opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
        output.log(f"reading headers of {opened.description} ...")
        # A production checkpoint has ~80 shards and 930k tensors: on a terminal, a bar per stage with its count.
        with output.stage_progress(enabled=output.progress_enabled(as_json)) as advance:
            document = build_inspect(open_checkpoint(opened, progress=advance), chosen)
        if as_json:
            output.emit_json(document)
            return
        lines = render_markdown(document) if markdown else render_text(document)
        for line in lines:
            output.print_line(line)
