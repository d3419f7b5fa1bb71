"""`trellis inspect --tp N`: what each rank of a server at TP N holds, from headers alone.

Per MoE layer: K per projection (how many experts each projection has at each K, from the trellis shapes: an R7
layer's map), and the routed-expert bytes one rank holds at TP N. A rank-sliced checkpoint is served at its own
TP only (its rank slices are what a rank loads; at another TP there is no answer, None). An unsliced one (R7,
plain exl3) is cut per rank at load: the trellis and the intermediate-side vectors split N ways, the hidden-side
vectors (per expert or layer-shared) stay whole on every rank. Which engines accept N is validate's verdict; the
CLI adds it to the document (engines.tp_verdicts).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, TypedDict

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, LinearRef, MoeLayer
from trellis_cli.checkpoint.names import H_SIDE
from trellis_cli.findings import TpVerdict


def projection_k_map(layer: MoeLayer) -> dict[str, dict[str, int]]:
    """projection -> {"K3": experts, ...}, from the trellis shapes (an expert whose ranks disagree is left out)."""
    out: dict[str, Counter[int]] = {p: Counter() for p in PROJECTIONS}
    for projs in layer.experts.values():
        for proj, by_rank in projs.items():
            ks = {lin.k for lin in by_rank.values()}
            k = ks.pop() if len(ks) == 1 else None
            if proj in out and k is not None:
                out[proj][k] += 1
    return {p: {f"K{k}": n for k, n in sorted(c.items())} for p, c in out.items() if c}


def layer_bytes_at_tp(ckpt: Checkpoint, layer: MoeLayer, tp: int) -> int | None:
    """Routed-expert bytes one rank of a TP-`tp` server holds for this layer; None when the checkpoint's rank
    slices are for another TP."""
    if layer.rank_sliced:  # each rank loads its own stored slices, at the checkpoint's TP only
        if tp != ckpt.tp:
            return None
        per_rank: Counter[int] = Counter()
        for projs in layer.experts.values():
            for by_rank in projs.values():
                for rank, lin in by_rank.items():
                    per_rank[rank] += _linear_bytes(lin, None, 1)
        for (_, rank), fields in layer.shared_h.items():
            per_rank[rank] += sum(ref.nbytes for ref in fields.values())
        return max(per_rank.values(), default=0)
    total = 0
    for projs in layer.experts.values():
        for proj, by_rank in projs.items():
            for lin in by_rank.values():
                total += _linear_bytes(lin, proj, tp)
    return total + sum(ref.nbytes for ref in layer.r7_shared.values())


def _linear_bytes(lin: LinearRef, proj: str | None, tp: int) -> int:
    """One linear's bytes on one rank: with `proj` (unsliced storage) the trellis and the intermediate-side
    vector are split `tp` ways and the hidden-side one is whole; without, the stored slice as it is."""
    total = 0
    for name in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1"):
        ref = getattr(lin, name)
        if ref is None:
            continue
        side = {"su": "suh", "suh": "suh", "sv": "svh", "svh": "svh"}.get(name)
        whole = proj is None or name in ("mcg", "mul1") or side == H_SIDE[proj]
        total += ref.nbytes if whole else ref.nbytes // tp
    return total + sum(ref.nbytes for ref in lin.extra)


class TpLayerRow(TypedDict):
    layer: int
    projection_k: dict[str, dict[str, int]]  # projection -> K -> experts
    bytes_per_rank: int | None  # None: rank slices stored for another TP


class _ServeTpFields(TypedDict):
    tp: int
    layers: list[TpLayerRow]
    routed_bytes_per_rank: int | None


class ServeTpView(_ServeTpFields, total=False):
    """`inspect --tp N`'s `serve_tp` section, in its JSON key order."""

    note: str  # a container whose per-rank bytes are in its own rows: why `layers` is empty
    engines: dict[str, TpVerdict]  # each engine's TP contract at N (validate's tp_verdicts, joined by the entry)


def tp_view(ckpt: Checkpoint, layers: list[int], tp: int) -> ServeTpView:
    rows: list[TpLayerRow] = []
    for li in layers:
        layer = ckpt.layers[li]
        rows.append({"layer": li, "projection_k": projection_k_map(layer),
                     "bytes_per_rank": layer_bytes_at_tp(ckpt, layer, tp)})
    sizes = [r["bytes_per_rank"] for r in rows]
    known = [s for s in sizes if s is not None]
    return {"tp": tp, "layers": rows, "routed_bytes_per_rank": sum(known) if len(known) == len(sizes) else None}


def render_tp_view(view: ServeTpView, human_bytes: Callable[[int], str]) -> list[str]:
    tp = view["tp"]
    total = view["routed_bytes_per_rank"]
    if view.get("note"):
        lines = [f"at TP {tp}: {view['note']}"]
    else:
        lines = [f"at TP {tp}: routed experts per rank "
                 + (human_bytes(total) if total is not None else "- (rank slices are for another TP)")]
    for row in view["layers"]:
        ks = " · ".join(f"{proj} " + "/".join(f"{k} {n}" for k, n in counts.items())
                        for proj, counts in row["projection_k"].items())
        size = human_bytes(row["bytes_per_rank"]) if row["bytes_per_rank"] is not None else "-"
        lines.append(f"  layer {row['layer']}: {size} per rank; K per projection: {ks}")
    for name, verdict in view.get("engines", {}).items():
        lines.append(f"  {name}: " + ("accepts" if verdict["accepts"] else f"refuses ({verdict['reason']})"))
    return lines
