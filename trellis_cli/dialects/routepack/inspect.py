"""`trellis inspect` of a route pack: its manifest's description (verify.describe_route_pack) in the keys and
notation of a TR3 inspect (the manifest on disk keeps its own names)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypedDict

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.inspect_doc import Geometry, InspectSummary

if TYPE_CHECKING:  # verify reads files; this module is also asked only for layer file names
    from trellis_cli.dialects.routepack.verify import ManifestLayer, RoutePackDescription

LAYER_FILE = re.compile(r"layer-([0-9]+)-rank-[0-9]+\.safetensors")


class RoutePackLayer(TypedDict):
    """One layer of the route pack in a TR3 inspect's terms, in its JSON key order."""

    layer: int
    bpw: float
    partition: str
    k_values: list[Any]  # the manifest's values (checked by manifest_findings before this is read)
    experts: int
    tiers: dict[str, Any]  # "K<k>" -> its experts as id ranges


class RoutePackView(TypedDict):
    """The document's `route_pack`: the manifest's description with its geometry and layers in TR3's terms."""

    format: str
    schema_version: int
    path: str
    source: dict[str, Any]
    geometry: Geometry
    tp: int
    ranks: Any
    codebook: str
    rotation: str
    layers: list[RoutePackLayer]
    files: int
    layer_file_bytes: int
    total_bytes: int
    manifest_problems: list[str]


class RoutePackDocument(InspectSummary):
    route_pack: RoutePackView
    purpose: str  # what a route pack is for (no engine loads it)


def route_pack_document(ckpt: Checkpoint, layers: list[int] | None, purpose: str) -> RoutePackDocument:
    from trellis_cli.dialects.inspect_doc import describe_source
    from trellis_cli.dialects.routepack.verify import describe_route_pack

    pack = _as_tr3_terms(describe_route_pack(ckpt.source))
    if layers is not None:  # as for a checkpoint: every chosen layer must be there, and only those show
        from trellis_cli.selection import require_present

        require_present(layers, [row["layer"] for row in pack["layers"]])
        pack["layers"] = [row for row in pack["layers"] if row["layer"] in layers]
    return {"dialect": ckpt.dialect, "source": describe_source(ckpt), "route_pack": pack, "purpose": purpose}


def _as_tr3_terms(pack: RoutePackDescription) -> RoutePackView:
    """Geometry as hidden / intermediate / intermediate_per_rank / experts, tiers as K -> id ranges (the other
    keys as the manifest's description gives them, in its order)."""
    g = pack["geometry"] or {}
    tp = pack["tp"]
    per_rank = g.get("intermediate_rank")
    geometry: Geometry = {"hidden": g.get("hidden"),
                          "intermediate": g.get("intermediate", per_rank * tp if per_rank and tp else None),
                          "intermediate_per_rank": per_rank, "experts": g.get("num_experts"), "tp": tp,
                          "codebook": pack["codebook"], "rotation_layout": pack["rotation"]}
    return {"format": pack["format"], "schema_version": pack["schema_version"], "path": pack["path"],
            "source": pack["source"], "geometry": geometry, "tp": tp, "ranks": pack["ranks"],
            "codebook": pack["codebook"], "rotation": pack["rotation"],
            "layers": [_layer_in_tr3_terms(layer) for layer in pack["layers"]], "files": pack["files"],
            "layer_file_bytes": pack["layer_file_bytes"], "total_bytes": pack["total_bytes"],
            "manifest_problems": pack["manifest_problems"]}


def _layer_in_tr3_terms(layer: ManifestLayer) -> RoutePackLayer:
    tiers = layer["tiers"]
    return {"layer": layer["layer"], "bpw": layer["bpw"],
            "partition": "/".join(str(t.get("size")) for t in tiers) or "-",
            "k_values": [t.get("k") for t in tiers], "experts": sum(t.get("size", 0) for t in tiers),
            "tiers": {f"K{t.get('k')}": t.get("experts") for t in tiers}}


def layer_files(ckpt: Checkpoint) -> dict[str, int]:
    """Layer file (layer-LLL-rank-R.safetensors) -> the MoE layer it holds."""
    out = {}
    for name in ckpt.files:
        m = LAYER_FILE.fullmatch(name)
        if m:
            out[name] = int(m.group(1))
    return out
