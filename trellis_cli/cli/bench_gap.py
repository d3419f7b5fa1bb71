"""`trellis bench --mixed-gap`: the mixed synthetic layer beside uniform layers of each K, as one table."""

from __future__ import annotations

from trellis_cli.cli import output


def print_mixed_gap(report: dict, description: str) -> None:
    from rich.table import Table

    mode = "cold" if report["cold"] else "warm"
    weights = " + ".join(f"{t['experts']}·K{t['k']}" for t in report["tiers"])
    total = sum(t["experts"] for t in report["tiers"])
    table = Table(title=output.cell(f"mixed-model gap: {description} ({report['mixed_bpw']:.3g} bpw), {mode} L2, "
                                    f"interpolated = ({weights})/{total}"))
    ks = [t["k"] for t in report["tiers"]]
    columns = ["M", *(f"K{k} µs" for k in ks), "mixed µs", "interp µs", "gap %", "touched "
               + "/".join(f"K{k}" for k in ks), "interp touched µs", "gap touched %"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in report["rows"]:
        table.add_row(str(r["m"]), *(f"{u['fused']['median_us']:.1f}" for u in r["uniform"]),
                      f"{r['mixed']['fused']['median_us']:.1f}", f"{r['interpolated_us']:.1f}",
                      f"{r['gap_pct']:+.1f}", "/".join(str(n) for n in r["mixed"]["tier_experts"]),
                      f"{r['touched_interpolated_us']:.1f}", f"{r['touched_gap_pct']:+.1f}")
    output.stdout.print(table)
