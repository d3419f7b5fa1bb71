"""What a route-pack repack would write and what would refuse it, known before any work: the name claims of a
route pack, and the quick plan of a local TR3 source (`Tr3ToRoutePack.quick_plan`; every other dry run is its
driver's `plan()`), which repack's staged run answers like any plan (OUT, the lock file, free space).

The quick dry run plans from the declarations (config.json, tier_bitmap.json: geometry and K per expert),
the listing (file sizes) and the raw header of each shard, in which it only counts names: which layers'
routed experts a shard holds and whether it holds anything else. A shard that mixes both is decoded once
(plain JSON, no per-tensor checks) to size the `extra/` file its other tensors make. The full header parse,
and the check that the tensors are what the declarations say, is left to the real run, which validates the
source before writing. A production TR3 (76 shards, ~930k tensors) is planned in well under a second this way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.routepack import write as rp_write
from trellis_cli.dialects.routepack.write import EXTRA_DIR
from trellis_cli.checkpoint import reader
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME, layer_file_name
from trellis_cli.dialects.conversion import NOT_VALIDATED, OutputPlan, refuse_collisions
from trellis_cli.dialects.source_facts import CONFIG, NOT_COPIED, fingerprint, protected_paths
from trellis_cli.selection import parse_selection
from trellis_cli.dialects.tp_reslice import rank_pieces, resolve_target_tp
from trellis_cli.dialects.routepack.plan import route_pack_layer_bytes
from trellis_cli.stwriter import PlannedTensor

FROM_DECLARATIONS = ("layer file sizes planned from the declarations (config.json, tier_bitmap.json) and the "
                     "shards' names; the headers' tensors are parsed and checked against them by the real run")


def refuse_pack_collisions(layer_files: list[tuple[str, int, int]], copied: list[str], carried: list[str]) -> None:
    """Every name a route pack writes belongs to exactly one output (checked before any work).

    `layer_files`: (file, layer, rank) of each layer file; `copied`: source files copied as they are;
    `carried`: source shards whose non-expert tensors go to extra/<shard>."""
    rp_write.refuse_reserved(copied)
    extras = [f"{EXTRA_DIR}/{name}" for name in carried]
    refuse_collisions(rp_write.claims(layer_files, carried, copied), [file for file, _, _ in layer_files] + extras
                      + [MANIFEST_NAME])


def route_pack_plan(out: Path, options: Any, ck: Checkpoint, layer_files: list[dict[str, Any]],
                    other_files: list[dict[str, Any]], needed: int, *, layers: list[int], ranks: list[int], tp: int,
                    used: list[str], notes: list[str]) -> OutputPlan:
    """The plan of a route-pack repack from the declarations: the same fields as the full plan
    (tr3_to_route_pack.Tr3ToRoutePack.plan)."""
    files = layer_files + other_files + [{"name": CONFIG}, {"name": MANIFEST_NAME}]  # the last two are small
    return OutputPlan(conversion=f"{ck.dialect} -> route-pack", out=out, protected=protected_paths(ck),
                      fingerprint=fingerprint(ck, options, used), files=files, bytes_needed=needed,
                      progress_total=sum(f["data_bytes"] for f in layer_files),
                      selection={"layers": layers, "ranks": list(ranks), "tp": tp}, notes=notes)


def quick_plan(ck: Checkpoint, out: Path, options: Any) -> OutputPlan | None:
    """The plan of a TR3 checkpoint opened from its declarations (`open_declared`) without parsing its headers
    (see the module docstring); None where that is not possible (a declaration it cannot plan from): the
    caller then opens the checkpoint in full."""
    scan = _scan_shards(ck)
    if scan is None:
        return None
    return _plan_from_declarations(ck, scan, out, options)


class _ShardScan:
    """One shard as its raw header shows it: the layers of its routed experts, and its other tensors when it
    has both (None when it holds only experts, or nothing but other tensors)."""

    def __init__(self, names: reader.HeaderNames) -> None:
        self.layers, self.experts, self.tensors = names.layers, names.experts, names.tensors
        self.others: list[PlannedTensor] | None = None
        self.metadata: dict[str, str] | None = names.metadata
        self.trellis = names.trellis
        if names.others is not None:
            self.others = [PlannedTensor(name, dtype, shape) for name, dtype, shape in names.others]
            for tensor in self.others:
                _ = tensor.nbytes  # an unknown dtype or a bad shape was refused by the reader


def _scan_shards(ck: Checkpoint) -> dict[str, _ShardScan] | None:
    # the reader's guards and the full parser's refusals, as the full opening meets them
    names = reader.every_header_names(ck.source, ck.files)
    if names is None:
        return None  # the full opening reports it by name
    scans = {name: _ShardScan(found) for name, found in names.items()}
    found = {layer for scan in scans.values() for layer in scan.layers}
    if any(layer not in found for layer, moe in ck.layers.items() if moe.declared_k is not None):
        return None  # a declared layer no shard holds (a shard missing, or unreadable): the full opening says which
    return scans


def _plan_from_declarations(ck: Checkpoint, scans: dict[str, _ShardScan], out: Path,
                            options: Any) -> OutputPlan | None:
    from trellis_cli.dialects import carry

    hidden, inter, experts = ck.hidden, ck.intermediate, ck.num_experts
    if not hidden or not inter or not experts:
        return None
    layer_shards: dict[int, list[str]] = {}
    for name, scan in scans.items():
        for layer in scan.layers:
            layer_shards.setdefault(layer, []).append(name)
    tp = resolve_target_tp(options.tp, ck.tp)
    if tp != ck.tp:
        rank_pieces(inter, ck.tp, tp, 0)  # raises if inexpressible
    layers = parse_selection(options.layers, list(layer_shards), "layers")
    ranks = parse_selection(options.ranks, list(range(tp)), "ranks")
    shared = options.shared_h or ck.rotation_layout == "shared_h_v1"
    layer_files: list[dict[str, Any]] = []
    jobs = []
    size_total = 0
    for layer in layers:
        moe = ck.layers.get(layer)
        ks = moe.declared_k if moe is not None else None
        if not isinstance(ks, list) or len(ks) != experts or not all(type(k) is int for k in ks):
            return None  # the declaration does not say every expert's K: only the headers can
        tiers = {k: ks.count(k) for k in sorted(set(ks))}
        if not _codes_as_declared(ck, scans, layer_shards[layer], tiers):
            return None  # the shapes of the codes are not what the declarations say: the full opening plans
        size = route_pack_layer_bytes(hidden, inter // tp, experts, experts, tiers, shared)
        for rank in ranks:
            layer_files.append({"name": layer_file_name(layer, rank), "data_bytes": size})
            jobs.append((layer_file_name(layer, rank), layer, rank))
            size_total += size
    used = _used_files(ck, scans, layers, layer_shards, options.copy_other)
    with_experts = {n for n, s in scans.items() if s.experts}
    copied = [n for n in used if n not in (CONFIG, *NOT_COPIED) and n not in with_experts]
    carried = {n: s for n, s in scans.items() if s.others and options.copy_other}
    refuse_pack_collisions(jobs, copied, list(carried))
    sizes = {n: max(ck.files.get(n, 0), 0) for n in copied}
    sizes.update({f"{EXTRA_DIR}/{n}": carry.file_bytes(s.others or [], s.metadata) for n, s in carried.items()})
    other_files: list[dict[str, Any]] = [{"name": n, "bytes": size} for n, size in sizes.items()]
    needed = size_total + sum(sizes.values())
    return route_pack_plan(out, options, ck, layer_files, other_files, needed, layers=layers, ranks=ranks, tp=tp,
                           used=used, notes=[NOT_VALIDATED, FROM_DECLARATIONS])


def _codes_as_declared(ck: Checkpoint, scans: dict[str, _ShardScan], shards: list[str], tiers: dict[int, int]) -> bool:
    """Whether the shards holding a layer (and no other layer) hold exactly the codes its declarations imply:
    every expert's three projections on every rank, shaped for its declared K. The layer's route-pack bytes are
    then what the full opening computes from the headers."""
    if any(len(scans[name].layers) != 1 for name in shards):
        return False
    hidden, rank_width, tp = ck.hidden or 0, (ck.intermediate or 0) // max(ck.tp, 1), max(ck.tp, 1)
    expected: dict[tuple[int, ...], int] = {}
    for k, count in tiers.items():
        gate_up: tuple[int, ...] = (hidden // 16, rank_width // 16, 16 * k)
        down: tuple[int, ...] = (rank_width // 16, hidden // 16, 16 * k)
        for shape, n in ((gate_up, 2), (down, 1)):
            expected[shape] = expected.get(shape, 0) + n * tp * count
    codes = [scans[name].trellis for name in shards]
    # Every shape in the count it should have, and no code besides: the found counts are the expected ones.
    return all(sum(c.of(shape) for c in codes) == n for shape, n in expected.items()) and \
        sum(c.total for c in codes) == sum(expected.values())


def _used_files(ck: Checkpoint, scans: dict[str, _ShardScan], layers: list[int],
                layer_shards: dict[int, list[str]], copy_other: bool) -> list[str]:
    """The source files a run reads (as `source_facts.used_source_files` lists them from the full model)."""
    used = {f for layer in layers for f in layer_shards[layer]}
    for name in ck.files:
        if not name.endswith(".safetensors") and name not in NOT_COPIED and (copy_other or name == CONFIG):
            used.add(name)
    if copy_other:
        used.update(n for n, s in scans.items() if not s.experts or s.experts != s.tensors)
    return sorted(n for n in used if not n.endswith(".safetensors.index.json"))
