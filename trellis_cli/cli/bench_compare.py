"""`trellis bench --compare PEER`: the peer timed beside our kernel, in the throughput table and JSON."""

from __future__ import annotations

from trellis_cli.cli import output
from trellis_cli.errors import UsageError

PEERS = ("exllamav3",)


def check_compare(peer: str | None, *, smoke: bool, mixed_gap: bool, tp: int | None, device: str) -> None:
    """Usage errors of --compare, raised before anything touches a GPU."""
    if peer is None:
        return
    if peer not in PEERS:
        raise UsageError(f"--compare {peer!r}: known peers are {', '.join(PEERS)}")
    if smoke or mixed_gap or tp is not None or device != "cuda":
        raise UsageError("--compare times the peer beside the throughput run of one GPU; it does not combine "
                         "with --smoke, --mixed-gap, --tp or --device")


def locate_compare(peer: str | None):
    """The peer's installation, or the reason it is skipped (said in one line on stderr), or None without
    --compare. Cheap (nothing is imported), so it runs before the GPU check."""
    if peer is None:
        return None
    from trellis_cli.bench.peer_exllamav3 import locate_peer

    found = locate_peer()
    if isinstance(found, str):
        skip_notice(peer, found)
    return found


def build_compare(peer: str | None, location, top_k: int):
    """For `locate_compare`'s answer: a PeerCompare on this GPU (the peer's first import builds its
    extension), or the reason it is skipped (said in one line on stderr), or None without --compare."""
    if peer is None or isinstance(location, str):
        return location
    from trellis_cli.bench.peer_compare import PeerCompare
    from trellis_cli.bench.peer_exllamav3 import load_peer

    output.log(f"importing {peer}'s MoE layer (its first import builds its CUDA extension: minutes) ...")
    api = load_peer(location)
    if isinstance(api, str):
        skip_notice(peer, api)
        return api
    output.log(f"{peer} {api.version} imported")
    return PeerCompare(api, top_k, log=output.log)


def skip_notice(peer: str, reason: str) -> None:
    output.print_line(f"{peer} not importable: {reason}; skipping the comparison", err=True)


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


def compare_summary(peer: str | None, comparer, rows: list[dict]) -> tuple[dict, list[str]]:
    """The JSON's top-level `compare` (what ran, or why not) and the M's whose peer output was wrong."""
    if peer is None:
        return {}, []
    if isinstance(comparer, str):
        return {"compare": {"peer": peer, "skipped": comparer}}, []
    from trellis_cli.bench.peer_compare import disagreements

    return {"compare": {"peer": peer, "version": comparer.api.version, "skipped": None,
                        "ratio": f"{peer} µs / ours (above 1: ours is faster)"}}, disagreements(rows)
