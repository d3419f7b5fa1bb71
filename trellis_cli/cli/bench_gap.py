"""`trellis bench --mixed-gap`: the mixed synthetic layer beside uniform layers of each K, one table or JSON."""

from __future__ import annotations

from trellis_cli.bench.mixed_gap import GapPlan
from trellis_cli.cli import output


def run_mixed_gap_bench(plan: GapPlan, library, m_list: list[int], *, cold: bool, replays: int, seed: int,
                        as_json: bool) -> None:
    from trellis_cli.bench.environment import environment
    from trellis_cli.bench.mixed_gap import run_mixed_gap

    output.log(f"source: {plan.description}, with uniform "
               + " and ".join(f"K{k}" for _, k in plan.kept) + " layers of the same shape")
    report = run_mixed_gap(plan, library, m_list, cold=cold, replays=replays, seed=seed, log=output.log)
    if as_json:
        output.emit_json({"source": plan.description, "environment": environment(library), **report})
        return
    print_mixed_gap(report, plan.description)


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
