"""`trellis inspect` of a route pack: its manifest's description (verify.describe_route_pack) in the keys and
notation of a TR3 inspect (the manifest on disk keeps its own names)."""

from __future__ import annotations

import re
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint

LAYER_FILE = re.compile(r"layer-([0-9]+)-rank-[0-9]+\.safetensors")


def route_pack_document(ckpt: Checkpoint, layers: list[int] | None) -> dict[str, Any]:
    from trellis_cli.dialects.inspect_doc import describe_source
    from trellis_cli.dialects.routepack.verify import describe_route_pack

    pack = _as_tr3_terms(describe_route_pack(ckpt.source))
    if layers is not None:  # as for a checkpoint: every chosen layer must be there, and only those show
        from trellis_cli.selection import require_present

        require_present(layers, [row["layer"] for row in pack.get("layers", [])])
        pack["layers"] = [row for row in pack.get("layers", []) if row["layer"] in layers]
    return {"dialect": ckpt.dialect, "source": describe_source(ckpt), "route_pack": pack}


def _as_tr3_terms(pack: dict[str, Any]) -> dict[str, Any]:
    """Geometry as hidden / intermediate / intermediate_per_rank / experts, tiers as K -> id ranges."""
    g = pack.get("geometry") or {}
    tp = pack.get("tp")
    per_rank = g.get("intermediate_rank")
    pack["geometry"] = {"hidden": g.get("hidden"),
                        "intermediate": g.get("intermediate", per_rank * tp if per_rank and tp else None),
                        "intermediate_per_rank": per_rank, "experts": g.get("num_experts"), "tp": tp,
                        "codebook": pack.get("codebook"), "rotation_layout": pack.get("rotation")}
    for layer in pack.get("layers", []):
        tiers = layer.pop("tiers", [])
        layer.update(partition="/".join(str(t.get("size")) for t in tiers) or "-",
                     k_values=[t.get("k") for t in tiers], experts=sum(t.get("size", 0) for t in tiers),
                     tiers={f"K{t.get('k')}": t.get("experts") for t in tiers})
    return pack


def layer_files(ckpt: Checkpoint) -> dict[str, int]:
    """Layer file (layer-LLL-rank-R.safetensors) -> the MoE layer it holds."""
    out = {}
    for name in ckpt.files:
        m = LAYER_FILE.fullmatch(name)
        if m:
            out[name] = int(m.group(1))
    return out
