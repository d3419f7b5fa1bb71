"""The one-screen rendering of `trellis fit`: a table per rank (one column for equal ranks) and a verdict."""

from __future__ import annotations

from rich.table import Table

from trellis_cli.cli import output
from trellis_cli.fit.budget import RankBudget
from trellis_cli.fit.run import FITS, MARGINAL, FitResult
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


def _band(term) -> str:
    if not term.measured:
        return "exact"
    return f"{term.low / GIB:.2f}-{term.high / GIB:.2f} GiB" + (", outside the budget" if term.outside else "")


def render(result: FitResult, description: str, dialect: str) -> None:
    r, kv, layout = result.request, result.kv, result.layout
    usable = result.ranks[0].usable_bytes
    version = r.version
    output.print_line(f"{description} ({dialect}) on {r.tp} x {r.gpu.description} ({gib(r.gpu.total_bytes)}, "
                      f"{r.gpu.family}) x utilization {r.utilization:g} = {gib(usable)} per GPU; TP{r.tp} DCP{r.dcp}"
                      + (", MTP loaded" if r.mtp else "")
                      + (f", {gib(r.mem_in_use)} already in use" if r.mem_in_use else ""))
    output.print_line(f"engine: {version.label} (--engine {version.name}); max_num_seqs {r.seqs}, "
                      f"max_num_batched_tokens {r.batched}")
    output.print_line(f"KV --kv-dtype {layout.asked}: stored as {layout.stored} by {layout.backend}, "
                      f"{kv.latent_per_layer} B latent x {kv.latent_layers} layers + {kv.indexer_per_layer} B indexer "
                      f"x {kv.indexer_layers} layers" + (f", / DCP {r.dcp}" if r.dcp > 1 else "")
                      + f" = {kv.rank_bytes:,.0f} B per token per rank; blocks of {kv.block_tokens} tokens")
    columns = _columns(result)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("per rank")
    table.add_column("sharding / band")
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
        table.add_row(f"reserve: {term.name}", _band(term), *(gib(term.typical) for _ in columns))
    table.add_row("KV budget (typical)", "", *(gib(b.kv_budget_bytes) for _, b in columns))
    table.add_row("KV tokens (typical)", "", *(f"{b.kv_tokens:,}" for _, b in columns))
    output.stdout.print(table)
    for note in result.notes:
        output.print_line(f"note: {note}")
    low, high = result.band["low"], result.band["high"]
    span = f"{high.pool_tokens:,}-{low.pool_tokens:,} KV tokens over the band"
    if result.verdict == FITS:
        output.print_line(f"fits: {span}, for a {result.ctx:,}-token context"
                          + (" (--ctx auto: the longest the whole band holds)" if r.ctx_auto else "")
                          + f"; {result.concurrent_requests:,} requests of {result.ctx:,} tokens at once "
                          f"(max_num_seqs {r.seqs})", style="green")
        return
    if result.verdict == MARGINAL:
        output.print_line(f"marginal: fits a {result.ctx:,}-token context at the cheap end of the measured terms "
                          f"but not at the expensive end ({span}; short by {gib(result.short_by_bytes)} per GPU at "
                          f"the expensive end); decided by {result.deciding_term}: measure it on the rig",
                          style="yellow")
    else:
        need = result.ranks[0].needed_bytes
        output.print_line(f"does not fit: short by {gib(result.short_by_bytes)} per GPU even at the cheap end of "
                          f"the band ({gib(need)} of KV for {result.ctx:,} tokens; {span})", style="red")
    for remedy in result.remedies:
        n = remedy.numbers
        detail = (f"{n['kv_tokens']:,} KV tokens at the expensive end, longest context at {r.seqs} sequences "
                  f"{n['longest_context']:,}" if "kv_tokens" in n else f"saves {gib(n['bytes_saved'])} per GPU "
                  f"({n['bytes_saved_per_expert']:,} B each, measured)")
        output.print_line(f"  remedy: {remedy.change}: {detail}" + (f" ({remedy.note})" if remedy.note else ""))
    if not result.remedies:
        output.print_line("  no remedy fit finds makes it fit (see --json for every term)")
