"""`trellis bench --compare PEER`: the peer's columns in the throughput table."""

from __future__ import annotations


def compare_columns(rows: list[dict]) -> list[str]:
    if not any("compare" in r for r in rows):
        return []
    peer = next(r["compare"]["peer"] for r in rows if "compare" in r)
    return [f"{peer} µs", "timed", f"{peer}/ours"]


def compare_cells(row: dict) -> list[str]:
    entry = row.get("compare")
    if entry is None:
        return []
    if not entry["agrees"]:
        return [f"wrong (rel L2 {entry['rel_l2']:.2g})", "-", "-"]
    return [f"{entry['us']:.1f}", "graph" if entry["graphs"] else "eager", f"{entry['ratio']:.2f}"]
