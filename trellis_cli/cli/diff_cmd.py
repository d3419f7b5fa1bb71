"""`trellis diff A B`: what changed between two checkpoints (declarations, tiers, every tensor), rendered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import CacheDirOpt, EndpointOpt, OfflineOpt, TokenOpt, open_cli_source
from trellis_cli.errors import EXIT_FINDINGS, UsageError

if TYPE_CHECKING:
    from trellis_cli.diff.result import DiffSide

MAX_LISTED = 10  # per group in the human and Markdown views; --json lists everything

HELP = (
    "Compare two checkpoints, local or on the Hub, of any dialects trellis reads: declarations key by key "
    "(config.json, quantization metadata, manifests, dialect, TP, codebook), MoE layers present in one only, "
    "per layer the experts whose K tier changed with bpw and bytes per rank before and after, and every "
    "tensor in the logical units of the normalized model (layer, expert, projection, rank: codes and rotation "
    "vectors; non-expert tensors by name), so TR3, exl3-v1 and route packs compare expert by expert.\n\n"
    "Identity is decided cheapest first: the Hub's LFS sha256 of files at the same byte range (no download), "
    "the same local file, then a streamed sha256 of each unit's bytes. Exit 0 when identical in content, 1 "
    "when anything differs.\n\n"
    "Examples:\n\n"
    "  trellis diff ./GLM-TR3 ./GLM-exl3v1\n\n"
    "  trellis diff org/model@v1 org/model@v2 --json\n\n"
    "  trellis diff org/model ./local-copy --revision-a main --layers 40 --markdown"
)


def diff_command(
    a: Annotated[str, typer.Argument(metavar="A", help="First checkpoint: directory, or Hub id org/name or "
                                                        "org/name@rev.")],
    b: Annotated[str, typer.Argument(metavar="B", help="Second checkpoint: directory, or Hub id org/name or "
                                                        "org/name@rev.")],
    revision_a: Annotated[Optional[str], typer.Option("--revision-a", help="Hub revision of A (branch, tag "
                                                      "or sha).", rich_help_panel="Source")] = None,
    revision_b: Annotated[Optional[str], typer.Option("--revision-b", help="Hub revision of B.",
                                                      rich_help_panel="Source")] = None,
    token: TokenOpt = None,
    offline: OfflineOpt = False,
    endpoint: EndpointOpt = None,
    cache_dir: CacheDirOpt = None,
    layers: Annotated[Optional[str], typer.Option(help="Only these MoE layers, e.g. 3-5,40 (non-expert "
                                                       "tensors are then not compared).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Emit one JSON document with every difference.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Emit Markdown tables.")] = False,
) -> None:
    from trellis_cli.diff.run import diff_sources
    from trellis_cli.selection import parse_layer_ranges

    if as_json and markdown:
        raise UsageError("--json and --markdown are exclusive: choose one output format")
    chosen = parse_layer_ranges(layers) if layers is not None else None
    opened = [open_cli_source(spec, revision, token, offline, endpoint, cache_dir)
              for spec, revision in ((a, revision_a), (b, revision_b))]
    with output.make_progress(enabled=output.progress_enabled(as_json)) as progress:
        # Opening shows each side's stages; the comparison's bars appear with their first count.
        tasks = {name: progress.add_task(name, total=None, bytes=name != "MoE layers compared", visible=False)
                 for name in ("MoE layers compared", "sha256", "download")}

        def advance(name: str, n: int = 0, completed: int | None = None, total: int | None = None) -> None:
            progress.update(tasks[name], advance=n, visible=True, completed=completed, total=total)  # None: kept

        result = diff_sources(*opened, layers=chosen,
                              on_open=lambda description: output.log(f"reading headers of {description} ..."),
                              open_progress=output.stage_advancer(progress),
                              progress=lambda n: advance("sha256", n),
                              download_progress=lambda n: advance("download", n),
                              on_layer=lambda done, total: advance("MoE layers compared", completed=done, total=total))
    if as_json:
        output.emit_json(result.to_dict())
    else:
        for line in (render_markdown(result) if markdown else render_text(result)):
            output.print_line(line)
    if not result.identical:
        raise typer.Exit(code=EXIT_FINDINGS)


# ---- the human view: grouped, capped with counts ------------------------------------------------------------

def _side_line(name: str, side: DiffSide) -> str:
    where = output.printable(side.description)
    tp = "TP any (slot layout)" if side.tp is None else f"TP {side.tp}"
    return f"{name}: {where} ({side.dialect}, {tp}, codebook {side.codebook})"


def _value(value: Any, limit: int = 60) -> str:
    text = "(absent)" if value is None else str(value)
    return output.printable(text if len(text) <= limit else text[:limit - 3] + "...")


def _partition(p: dict[int, int]) -> str:
    return "/".join(str(n) for n in p.values()) + " (" + "/".join(f"K{k}" for k in p) + ")" if p else "-"


def _bytes(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{max(values) / 2**20:,.2f} MiB" if len(set(values)) == 1 else \
        "/".join(f"{v / 2**20:,.2f}" for v in values) + " MiB"


def _ids(ids: list[int]) -> str:
    from trellis_cli.id_ranges import compact_ranges

    return compact_ranges(ids)


def _tier_line(change_list, what: str) -> list[str]:
    groups: dict[tuple, list[int]] = {}
    for c in change_list:
        groups.setdefault((c.k_a, c.k_b), []).append(c.expert)
    return [f"{len(ids)} expert(s) {what}K{ka if ka is not None else '?'}→K{kb if kb is not None else '?'}: "
            f"{_ids(ids)}" for (ka, kb), ids in sorted(groups.items(), key=lambda g: str(g[0]))]


def _difference_groups(result) -> list[tuple[str, list[str]]]:
    groups: dict[tuple, list[str]] = {}
    for d in result.differences:
        where = "non-expert tensors" if d.layer is None else f"layer {d.layer}"
        groups.setdefault((d.layer is None, d.layer or 0, where, d.status, d.method), []).append(_unit_label(d))
    return [(f"{where}, {status} by {method} ({len(labels):,})", labels)
            for (_, _, where, status, method), labels in sorted(groups.items(), key=lambda g: g[0][:2] + g[0][3:])]


def _unit_label(d) -> str:
    if d.tensor is not None:
        return output.printable(d.tensor)
    return f"expert {d.expert} {d.projection} rank {d.rank} {d.part}"


def _capped(items: list[str], limit: int = MAX_LISTED) -> list[str]:
    return items[:limit] + ([f"... and {len(items) - limit:,} more (--json lists all)"] if len(items) > limit else [])


def render_text(result) -> list[str]:
    lines = [_side_line("A", result.a), _side_line("B", result.b)]
    layers = _ids(result.layers_compared) or "none"
    lines.append(f"compared at TP {result.compared_tp}: MoE layers {layers} ({len(result.layers_compared)})"
                 + ("" if result.other_tensors_compared else "; non-expert tensors not compared (--layers)"))
    if result.structure:
        lines += ["", f"declarations ({len(result.structure)} differ):"]
        lines += _capped([f"  {c.what} {output.printable(c.key)}: {_value(c.a)} -> {_value(c.b)}"
                          for c in result.structure])
    if result.layers_only_a or result.layers_only_b:
        lines.append("")
        if result.layers_only_a:
            lines.append(f"MoE layers only in A: {_ids(result.layers_only_a)}")
        if result.layers_only_b:
            lines.append(f"MoE layers only in B: {_ids(result.layers_only_b)}")
    changed = [layer for layer in result.layers if layer.tier_changes or layer.declared_changes
               or layer.partition_a != layer.partition_b or layer.bpw_a != layer.bpw_b
               or layer.bytes_per_rank_a != layer.bytes_per_rank_b]
    if changed:
        lines += ["", "tiers:"]
        for layer in changed:
            for text in _tier_line(layer.tier_changes, ""):
                lines.append(f"  layer {layer.layer}: {text}")
            for text in _tier_line(layer.declared_changes, "declared "):
                lines.append(f"  layer {layer.layer}: {text}")
            lines.append(f"    partition {_partition(layer.partition_a)} -> {_partition(layer.partition_b)}, "
                         f"bpw {layer.bpw_a} -> {layer.bpw_b}, bytes per rank {_bytes(layer.bytes_per_rank_a)} -> "
                         f"{_bytes(layer.bytes_per_rank_b)}")
    groups = _difference_groups(result)
    if groups:
        lines += ["", f"tensors ({len(result.differences):,} differ):"]
        for title, labels in groups:
            lines.append(f"  {title}:")
            lines += [f"    {label}" for label in _capped(labels)]
    lines += ["", "decided by: " + (", ".join(f"{method} {n:,}" for method, n in sorted(result.methods.items()))
                                    or "nothing to compare"), result.summary()]
    return lines


def render_markdown(result) -> list[str]:
    def row(*cells: Any) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    lines = ["# trellis diff", "", row("", "source", "dialect", "TP", "codebook"), row("---", "---", "---", "---", "---")]
    for name, side in (("A", result.a), ("B", result.b)):
        lines.append(row(name, output.printable(side.description), side.dialect,
                         side.tp if side.tp is not None else "any", side.codebook))
    if result.structure:
        lines += ["", f"## Declarations ({len(result.structure)} differ)", "", row("file", "key", "A", "B"),
                  row("---", "---", "---", "---")]
        shown = result.structure[:MAX_LISTED]
        lines += [row(c.what, output.printable(c.key), _value(c.a), _value(c.b)) for c in shown]
        if len(result.structure) > MAX_LISTED:
            lines += ["", f"... and {len(result.structure) - MAX_LISTED:,} more (--json lists all)"]
    if result.layers:
        lines += ["", "## MoE layers", "", row("layer", "partition A", "partition B", "bpw A", "bpw B",
                                               "bytes/rank A", "bytes/rank B", "tier changes", "units differing"),
                  row(*["---"] * 9)]
        for layer in result.layers:
            differing = sum(n for status, n in layer.counts.items() if status != "identical")
            changes = "; ".join(_tier_line(layer.tier_changes, "")) or "-"
            lines.append(row(layer.layer, _partition(layer.partition_a), _partition(layer.partition_b), layer.bpw_a,
                             layer.bpw_b, _bytes(layer.bytes_per_rank_a), _bytes(layer.bytes_per_rank_b), changes,
                             differing))
    if result.layers_only_a or result.layers_only_b:
        lines += ["", f"MoE layers only in A: {_ids(result.layers_only_a) or 'none'}; only in B: "
                      f"{_ids(result.layers_only_b) or 'none'}"]
    groups = _difference_groups(result)
    if groups:
        lines += ["", f"## Tensors ({len(result.differences):,} differ)", "", row("group", "units"), row("---", "---")]
        lines += [row(title, ", ".join(_capped(labels))) for title, labels in groups]
    lines += ["", "Decided by: " + (", ".join(f"{m} {n:,}" for m, n in sorted(result.methods.items())) or "nothing"),
              "", f"**{result.summary()}**"]
    return lines
