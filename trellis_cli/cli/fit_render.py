"""The one-screen rendering of `trellis fit`: a table per rank (one column for equal ranks) and a verdict."""

from __future__ import annotations

from rich.table import Table

from trellis_cli.cli import output
from trellis_cli.fit.budget import RankBudget
from trellis_cli.fit.run import FitResult
from trellis_cli.fit.sharding import PARTS, PART_EXPERTS
from trellis_cli.fit.weights import styles_shown

GIB = 1 << 30


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _columns(result: FitResult) -> list[tuple[str, RankBudget]]:
    """(heading, RankBudget) per distinct rank: ranks with identical numbers share one column."""
    groups: dict[tuple, list] = {}
    for b in result.ranks:
        key = (b.weight_bytes, b.absent_bytes, b.kv_budget_bytes, tuple(sorted(b.weights.parts.items())))
        groups.setdefault(key, []).append(b)
    out = []
    for members in groups.values():
        ids = [m.rank for m in members]
        name = f"rank {ids[0]}" if len(ids) == 1 else (f"ranks {ids[0]}-{ids[-1]}" if ids == list(
            range(ids[0], ids[-1] + 1)) else "ranks " + ",".join(map(str, ids)))
        out.append((name, members[0]))
    return out


def _tiers(b) -> str:
    shown = [f"K{k}: {t.experts}" for k, t in sorted((k, t) for k, t in b.weights.tiers.items() if k is not None)]
    return ", ".join(shown)


def render(result: FitResult, description: str, dialect: str) -> None:
    r, kv = result.request, result.kv
    usable = result.ranks[0].usable_bytes
    output.print_line(f"{description} ({dialect}) on {r.tp} x {r.gpu.description} ({gib(r.gpu.total_bytes)}) x "
                      f"{r.gpu_memory_utilization:g} = {gib(usable)} per GPU; TP{r.tp} DCP{r.dcp}, engine {r.engine}"
                      + (", MTP loaded" if r.mtp else ""))
    output.print_line(f"KV {r.kv_dtype}: {kv.latent_per_layer} B latent x {kv.latent_layers} layers + "
                      f"{kv.indexer_per_layer} B indexer x {kv.indexer_layers} layers"
                      + (f", / DCP {r.dcp}" if r.dcp > 1 else "") + f" = {kv.rank_bytes:,.0f} B per token per rank")
    columns = _columns(result)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("per rank")
    table.add_column("sharding")
    for name, _ in columns:
        table.add_column(name, justify="right")
    styles = styles_shown(result.weights)
    for part in PARTS:
        values = [b.weights.parts[part] for _, b in columns]
        if any(values):
            label = part + (f" ({_tiers(columns[0][1])})" if part == PART_EXPERTS and _tiers(columns[0][1]) else "")
            table.add_row(label, styles.get(part, ""), *(gib(v) for v in values))
    for part in PARTS:
        values = [b.weights.absent.get(part, 0) for _, b in columns]
        if any(values):
            table.add_row(f"{part} (not stored: bf16 estimate)", styles.get(part, ""), *(gib(v) for v in values))
    table.add_row("weights", "", *(gib(b.weight_bytes + b.absent_bytes) for _, b in columns))
    for term in result.reserve:
        table.add_row(f"reserve: {term.name}", "estimate" if term.estimate else "exact",
                      *(gib(term.bytes) for _ in columns))
    table.add_row("KV budget", "", *(gib(b.kv_budget_bytes) for _, b in columns))
    table.add_row("KV tokens", "", *(f"{b.kv_tokens:,}" for _, b in columns))
    output.stdout.print(table)
    for note in result.notes:
        output.print_line(f"note: {note}")
    if result.fits:
        output.print_line(f"fits: {result.pool_tokens:,} KV tokens for a {result.ctx:,}-token context; the longest "
                          f"context at {r.max_num_seqs} sequences is {result.longest_context:,}", style="green")
        return
    need = result.ranks[0].needed_bytes
    output.print_line(f"does not fit: short by {gib(result.short_by_bytes)} per GPU ({gib(need)} of KV for "
                      f"{result.ctx:,} tokens, {result.pool_tokens:,} tokens fit)", style="red")
    for remedy in result.remedies:
        n = remedy.numbers
        detail = (f"{n['kv_tokens']:,} KV tokens, longest context at {r.max_num_seqs} sequences {n['longest_context']:,}"
                  if "kv_tokens" in n else f"saves {gib(n['bytes_saved'])} per GPU "
                  f"({n['bytes_saved_per_expert']:,} B each, measured)")
        output.print_line(f"  remedy: {remedy.change}: {detail}" + (f" ({remedy.note})" if remedy.note else ""))
    if not result.remedies:
        output.print_line("  no single remedy makes it fit (see --json for every term)")
