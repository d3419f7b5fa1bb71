"""Conversions that write the TR3 layout (`--to tr3`): from a route pack, or from TR3 with --tp/--shared-h.

A TR3 shard holds every rank of its layers. The TR3 writer (dialects/tr3/write.py) decides which layers and
non-expert tensors go where and writes each shard rank by rank from one LayerPack at a time (dialects/tr3/
shard.py); tr3_output.py is the driver the staged run (staged_run.py) runs. After each shard is written it is read back and compared bit for bit
with the packs and the source tensors it came from; nothing is ever
rounded, so a conversion either is exact or is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.routepack.layout import layer_file_name
from trellis_cli.checkpoint.reader import source_header
from trellis_cli.id_ranges import expand_ranges
from trellis_cli.dialects import carry
from trellis_cli.dialects.routepack.layer_file import read_layer_pack
from trellis_cli.dialects.shard_pack import layer_tiers, pack_layer
from trellis_cli.selection import parse_selection
from trellis_cli.dialects.tp_reslice import rank_pieces, resolve_target_tp
from trellis_cli.dialects.source_facts import CONFIG, NOT_COPIED, SourceHashes, has_experts, protected_paths, vector_ndim
from trellis_cli.dialects.tr3.shard import Tr3Layer
from trellis_cli.dialects.tr3.write import Tr3Output, assign_shards, restored_config
from trellis_cli.dialects.tr3.driver import Tr3Driver, fingerprint_options
from trellis_cli.dialects.routepack import manifest as mf
from trellis_cli.dialects.conversion import check_output
from trellis_cli.sources import LocalSource


# ---- the two drivers ------------------------------------------------------------------------------------

def route_pack_to_tr3(root: Any, out: Path, options, validator=None) -> Tr3Driver:
    """A route-pack directory -> the TR3 layout (config, bitmap and other files restored, shards rebuilt)."""
    if not isinstance(root, Path):
        raise UsageError("a route pack converts back to TR3 from a local directory only")
    from trellis_cli.dialects.routepack.verify import require_route_pack

    if options.to != "tr3":
        raise UsageError(f"{root} is already a route pack; pass --to tr3 to convert it back to TR3")
    if options.tp is not None or options.ranks is not None:
        raise UsageError("--tp and --ranks apply when reading a TR3 checkpoint; repack the TR3 source instead")
    # Verification also checks every key and name of the manifest, so what follows can index it freely and
    # every name it joins onto OUT stays inside OUT. A real run hashes every file: the manifest's hashes hold
    # below (a dry run checks the structure and sizes only).
    require_route_pack(root, "the route pack", check_hashes=not options.dry_run)
    doc, _ = mf.read_manifest(root)
    tp = doc["tp"]
    if len(doc["ranks"]) != tp:  # distinct ranks below tp (verified): all of them when there are tp
        raise UsageError(f"{root}: holds ranks {doc['ranks']} of {tp}; a TR3 shard needs every rank")
    layers = parse_selection(options.layers, [int(k) for k in doc["layers"]], "layers")
    shared = doc["rotation"] == "shared_h" or options.shared_h
    ndim = doc["source"].get("vector_ndim", {})
    specs = {}
    for layer in layers:
        expert_k = {e: t["k"] for t in doc["layers"][str(layer)]["tiers"] for e in expand_ranges(t["experts"])}
        specs[layer] = Tr3Layer(layer, expert_k, tp, doc["geometry"]["hidden"], doc["geometry"]["intermediate_rank"],
                                doc["codebook"], shared, ndim.get("per_expert", 1), ndim.get("shared_h", 1))
    files = doc["files"]
    extras = {e["source_file"]: n for n, e in files.items() if e.get("role") == "extra"}
    pack_source = LocalSource(root)
    headers = {name: source_header(pack_source, name) for name in extras.values()}
    out_plan = Tr3Output(
        specs=specs, packs=lambda layer, rank: read_layer_pack(root, layer, rank),
        shards=assign_shards({layer: _tr3_shards(doc["layers"][str(layer)]) for layer in layers}),
        carried={shard: carry.refs_of(headers[name]) for shard, name in extras.items()},
        carried_source=pack_source,
        metadata={shard: headers[name].metadata for shard, name in extras.items()},
        copied={n: root / n for n, e in files.items() if e.get("role") == "copied"},
        config=restored_config(_pack_config(root), tp, shared), read_copied=lambda n: json.loads(
            (root / n).read_text(encoding="utf-8")),
        source_root=root,
        fingerprint={"source": str(root.resolve()), "manifest": doc.get("manifest_sha256"),
                     "options": fingerprint_options(options)})
    # The pack's files are hashed against its manifest above; a shard is tied to those hashes.
    layer_files = {layer: [layer_file_name(layer, r) for r in range(tp)] for layer in layers}
    out_plan.sources = lambda shard: {n: files[n]["sha256"] for n in _made_from(out_plan, shard, layer_files, extras)}
    out_plan.check_copy = lambda name, copy: _check_copy(name, copy, files[name]["sha256"])
    if validator is not None:
        out_plan.final_check = lambda tree: check_output(tree, validator, "TR3")
    notes = ("the route pack's files were not hashed (dry run): a real run checks them against its manifest "
             "first",)
    return Tr3Driver("route-pack -> tr3", out, out_plan, notes if options.dry_run else ())


def tr3_to_tr3(checkpoint: Checkpoint, out: Path, options, validator=None) -> Tr3Driver:
    """TR3 -> TR3 with --tp re-slicing and/or --shared-h, through in-memory packs (exact or refused)."""

    if options.ranks is not None:
        raise UsageError("--ranks does not apply with --to tr3 (a TR3 shard holds every rank)")
    tp = resolve_target_tp(options.tp, checkpoint.tp)
    hidden, inter = checkpoint.moe_sizes()
    rank_pieces(inter, checkpoint.tp, tp, 0)  # refuses an inexpressible --tp before anything is written
    layers = parse_selection(options.layers, [li for li, m in checkpoint.layers.items() if m.experts], "layers")
    shared = options.shared_h or checkpoint.rotation_layout == "shared_h_v1"
    ndim = vector_ndim(checkpoint)
    codebook = next(lin.codebook for m in checkpoint.layers.values() for projs in m.experts.values()
                    for ranks in projs.values() for lin in ranks.values())
    specs = {layer: Tr3Layer(layer, {e: k for k, ids in layer_tiers(checkpoint, layer) for e in ids}, tp,
                             hidden, inter // tp, codebook, shared, ndim["per_expert"], ndim["shared_h"])
             for layer in layers}
    carried = carry.non_expert_refs(checkpoint)
    out_plan = Tr3Output(
        specs=specs, packs=lambda layer, rank: pack_layer(checkpoint, layer, rank, tp=tp,
                                                          shared_h=True if options.shared_h else None),
        shards=assign_shards({layer: sorted(checkpoint.layers[layer].files) for layer in layers}),
        carried=carried, carried_source=checkpoint.source,
        metadata={name: header.metadata for name, header in checkpoint.headers.items()},
        copied={n: checkpoint.source.local_path(n) for n in checkpoint.files
                if n not in (CONFIG, *NOT_COPIED) and not n.endswith(".safetensors.index.json")
                and not has_experts(checkpoint, n)},
        config=restored_config(dict(checkpoint.config), tp, shared), read_copied=checkpoint.source.read_json,
        source_root=protected_paths(checkpoint),
        fingerprint={"source": checkpoint.source.describe(), "options": fingerprint_options(options)})
    hashes = SourceHashes(checkpoint)
    out_plan.check_copy = hashes.check_copy
    layer_files = {layer: sorted(checkpoint.layers[layer].files) for layer in layers}
    out_plan.sources = lambda shard: hashes.of(_made_from(out_plan, shard, layer_files, {n: n for n in carried}))
    return Tr3Driver(f"{checkpoint.dialect} -> tr3", out, out_plan)


def _check_copy(name: str, copy: Path, expected: str) -> None:
    if mf.sha256_file(copy) != expected:
        raise CheckFailed(f"{name}: the copy differs from the route pack's file (did it change during the repack?)")


def _tr3_shards(entry: dict[str, Any]) -> list[str]:
    """The TR3 shard(s) a pack's layer came from; `tr3_shard` names it for a pack made from exl3-v1."""
    return [entry["tr3_shard"]] if entry.get("tr3_shard") else entry.get("source_files", [])


def _made_from(plan: Tr3Output, shard: str, layer_files: dict[int, list[str]], carried_from: dict[str, str]):
    """The source files one output shard's bytes come from."""
    names = {f for layer in plan.shards.get(shard, []) for f in layer_files[layer]}
    if shard in carried_from:
        names.add(carried_from[shard])
    return names


def _pack_config(root: Path) -> dict[str, Any]:
    """The route pack's config.json (verified against the manifest's hash, but still any JSON)."""
    config = LocalSource(root).read_json("config.json")
    if not isinstance(config, dict):
        raise CheckFailed(f"{root / 'config.json'}: a JSON {type(config).__name__}, expected an object")
    return config
