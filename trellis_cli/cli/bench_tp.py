"""`trellis bench --tp N` (timing): the per-M table of kernel, all-reduce and layer times."""

from __future__ import annotations

from trellis_cli.cli import output


def print_tp_timing(doc: dict) -> None:
    from rich.table import Table

    mode = "cold" if doc["cold"] else "warm"
    table = Table(title=output.cell(f"{doc['source']}, {mode} L2, all-reduce {doc['out_dtype']} over "
                                    f"{doc['backend']}"))
    for column in ("M", "kernel min µs", "kernel max µs", "all-reduce µs", "layer µs", "layer/kernel", "experts",
                   "graphs"):
        table.add_column(column, justify="right")
    for r in doc["rows"]:
        table.add_row(str(r["m"]), f"{r['kernel']['min_us']:.1f}", f"{r['kernel']['max_us']:.1f}",
                      f"{r['all_reduce']['median_us']:.1f}", f"{r['layer']['median_us']:.1f}",
                      f"{r['layer_over_max_kernel']:.2f}", str(r["experts"]), "yes" if r["graphs"] else "eager")
    output.stdout.print(table)
