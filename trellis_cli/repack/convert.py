"""Conversions that write the TR3 layout (`--to tr3`): from a route pack, or from TR3 with --tp/--shared-h.

A TR3 shard holds every rank of its layers (tr3_output.py decides which layers and non-expert tensors go
where); it is written rank by rank from one LayerPack at a time (the header is planned first), so memory
stays at one layer-rank, and carried tensors are streamed (carry.py). Tensor names follow the TR3 schema, vectors
get back the shape the source stored ([n] or [1, n], recorded in the manifest), and codebook markers are
rewritten from the codebook. After each shard is written it is read back and compared bit for bit with
the packs and the source tensors it came from; nothing is ever rounded, so a conversion either is exact or is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, TensorRef
from trellis_cli.checkpoint.names import H_SIDE, I_SIDE, SHARED_H_TENSOR_SCHEMA, expert_key, shared_h_key
from trellis_cli.codebooks import MARKERS
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header import HeaderError, read_local_header
from trellis_cli.id_ranges import expand_ranges
from trellis_cli.repack import carry
from trellis_cli.repack import manifest as mf
from trellis_cli.repack.format import LayerPack, layer_file_name, split_descriptor
from trellis_cli.repack.layer_file import read_layer_pack
from trellis_cli.repack.pack import layer_tiers, pack_layer
from trellis_cli.repack.plan import parse_selection, rank_pieces, resolve_target_tp
from trellis_cli.repack.readback import same_bits
from trellis_cli.repack.source_bytes import TensorReader
from trellis_cli.sources import LocalSource
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter

if TYPE_CHECKING:
    from trellis_cli.repack.tr3_output import Tr3Output

ROTATION_LAYOUT = {True: "shared_h_v1", False: "per_expert_v1"}


@dataclass(frozen=True)
class Tr3Layer:
    """What one TR3 shard holds: geometry, K per expert, codebook, rotation layout, vector ranks."""

    layer: int
    expert_k: dict[int, int]
    tp: int
    hidden: int
    intermediate: int  # per rank
    codebook: str
    shared: bool
    vector_ndim: int = 1
    shared_ndim: int = 1

    def _vec_shape(self, n: int, ndim: int) -> tuple[int, ...]:
        return (n,) if ndim == 1 else (1, n)

    def slots(self) -> list[tuple[PlannedTensor, tuple]]:
        """Every tensor in file order (rank-major) with what fills it."""
        h, i = self.hidden, self.intermediate
        marker = MARKERS[self.codebook]
        out = []
        for rank in range(self.tp):
            for expert in sorted(self.expert_k):
                k = self.expert_k[expert]
                for p, proj in enumerate(PROJECTIONS):
                    fan_in, fan_out = (h, i) if proj != "down_proj" else (i, h)
                    out.append((PlannedTensor(expert_key(self.layer, expert, proj, rank, "trellis"), "I16",
                                              (fan_in // 16, fan_out // 16, 16 * k)), ("trellis", rank, expert, p)))
                    for field, n in (("suh", fan_in), ("svh", fan_out)):
                        if self.shared and field == H_SIDE[proj]:
                            continue
                        out.append((PlannedTensor(expert_key(self.layer, expert, proj, rank, field), "F16",
                                                  self._vec_shape(n, self.vector_ndim)), (field, rank, expert, p)))
                    if marker is not None:
                        out.append((PlannedTensor(expert_key(self.layer, expert, proj, rank, marker[0]), "I32", ()),
                                    ("marker", rank)))
            if self.shared:
                for p, proj in enumerate(PROJECTIONS):
                    out.append((PlannedTensor(shared_h_key(self.layer, proj, rank), "F16",
                                              self._vec_shape(h, self.shared_ndim)), ("shared", rank, None, p)))
        return out


def tensor_from_pack(spec: Tr3Layer, pack: LayerPack, planned: PlannedTensor, origin: tuple):
    """The bytes one TR3 tensor takes from a LayerPack, shaped as planned."""
    import torch

    kind, _rank, expert, p = (*origin, None, None)[:4]
    if kind == "marker":
        return torch.tensor(MARKERS[spec.codebook][1], dtype=torch.int32)
    tables = (pack.gate_suh, pack.up_suh, pack.down_svh)
    if kind == "shared":
        return _shared_row(tables[p], spec.layer, PROJECTIONS[p], pack.rank).reshape(planned.shape)
    combined = int(pack.global_to_combined[expert])
    if combined < 0:
        raise CheckFailed(f"layer {spec.layer} rank {pack.rank}: expert {expert} is not served by the pack")
    proj = PROJECTIONS[p]
    if kind == "trellis":
        tier, local = split_descriptor(int(pack.descriptors[combined]))
        return pack.tier_trellis[tier][local, p].reshape(planned.shape)
    if kind == I_SIDE[proj]:
        return pack.rot_intermediate[combined, p].reshape(planned.shape)
    table = tables[p]
    return table[0 if table.shape[0] == 1 else combined].reshape(planned.shape)


def _shared_row(table, layer: int, proj: str, rank: int):
    """The one hidden-side row of a projection; per-expert rows must all be byte-equal to collapse."""
    import torch

    bits = table.view(torch.int16)
    differs = (bits != bits[0:1]).any(dim=1).nonzero()
    if len(differs):
        raise CheckFailed(f"layer {layer} rank {rank}: {proj} {H_SIDE[proj]} rows differ (combined id "
                          f"{int(differs[0])} vs 0); shared-H needs them byte-equal (refused)")
    return table[0]


def write_tr3_shard(path: Path, specs: list[Tr3Layer], packs: Callable[[int, int], LayerPack],
                    carried: list[TensorRef], reader: TensorReader, metadata: dict[str, str],
                    on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Write one TR3 shard: each layer's tensors (one rank's pack in memory at a time), then the carried
    non-expert tensors, streamed. Returns the tensor names in file order."""
    plan = [t for spec in specs for t, _ in spec.slots()] + carry.planned(carried)
    with SafetensorsWriter(path, plan, metadata) as writer:
        for spec in specs:
            layer_packs = _cached_packs(lambda rank, layer=spec.layer: packs(layer, rank))
            for planned, origin in spec.slots():
                writer.write(planned.name, tensor_from_pack(spec, layer_packs(origin[1]), planned, origin))
                if on_bytes is not None:
                    on_bytes(planned.nbytes)
        carry.copy_into(writer, reader, carried, on_bytes)
    return [t.name for t in plan]


def check_tr3_shard(path: Path, specs: list[Tr3Layer], packs: Callable[[int, int], LayerPack],
                    carried: list[TensorRef], reader: TensorReader) -> None:
    """Read the shard back, parsing its header anew, and compare every tensor bit for bit with the packs and
    the carried sources (positional reads: the shard is never mapped or read whole)."""
    try:
        header = read_local_header(path, path.name)
    except (HeaderError, OSError) as e:
        raise CheckFailed(f"{path.name}: written file does not parse ({e})") from e
    expected = {t.name for spec in specs for t, _ in spec.slots()} | {r.name for r in carried}
    if set(header.tensors) != expected:
        raise CheckFailed(f"{path.name}: {sorted(set(header.tensors) ^ expected)[0]}: tensor set differs")
    back = {r.name: r for r in carry.refs_of(header)}
    with TensorReader(LocalSource(path.parent)) as written:
        for spec in specs:
            layer_packs = _cached_packs(lambda rank, layer=spec.layer: packs(layer, rank))
            for planned, origin in spec.slots():
                want = tensor_from_pack(spec, layer_packs(origin[1]), planned, origin)
                ref = back[planned.name]
                if (ref.dtype, ref.shape) != (planned.dtype, planned.shape) or not same_bits(written.read(ref), want):
                    raise CheckFailed(f"{path.name}: {planned.name}: read back differs from the route pack")
    carry.check_copies(path, carried, reader)


# ---- the two drivers ------------------------------------------------------------------------------------

def route_pack_to_tr3(root: Path, out: Path, options, *, on_bytes=None, on_total=None, log=None):
    """A route-pack directory -> the TR3 layout (config, bitmap and other files restored, shards rebuilt)."""
    from trellis_cli.repack.tr3_output import Tr3Output, Tr3Run, assign_shards
    from trellis_cli.repack.verify import verify_repacked

    if options.to != "tr3":
        raise UsageError(f"{root} is already a route pack; pass --to tr3 to convert it back to TR3")
    if options.tp is not None or options.ranks is not None:
        raise UsageError("--tp and --ranks apply when reading a TR3 checkpoint; repack the TR3 source instead")
    # Verification also checks every key and name of the manifest, so what follows can index it freely and
    # every name it joins onto OUT stays inside OUT. It hashes every file: the manifest's hashes hold below.
    report = verify_repacked(root)
    if not report.ok:
        raise CheckFailed(f"{root}: the route pack does not verify: {report.errors[0].line()}")
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
    out_plan = Tr3Output(
        specs=specs, packs=lambda layer, rank: read_layer_pack(root, layer, rank),
        shards=assign_shards({layer: _tr3_shards(doc["layers"][str(layer)]) for layer in layers}),
        carried={shard: carry.refs_of(read_local_header(root / name, name)) for shard, name in extras.items()},
        carried_source=LocalSource(root),
        metadata={shard: read_local_header(root / name, name).metadata for shard, name in extras.items()},
        copied={n: root / n for n, e in files.items() if e.get("role") == "copied"},
        config=_restored_config(_pack_config(root), tp, shared), read_copied=lambda n: json.loads(
            (root / n).read_text(encoding="utf-8")),
        source_root=root,
        fingerprint={"source": str(root.resolve()), "manifest": doc.get("manifest_sha256"),
                     "options": _options(options)})
    # The pack's files are hashed against its manifest above; a shard is tied to those hashes.
    layer_files = {layer: [layer_file_name(layer, r) for r in range(tp)] for layer in layers}
    out_plan.sources = lambda shard: {n: files[n]["sha256"] for n in _made_from(out_plan, shard, layer_files, extras)}
    return Tr3Run(out, options, out_plan, on_bytes, on_total, log).run()


def tr3_to_tr3(checkpoint: Checkpoint, out: Path, options, *, on_bytes=None, on_total=None, log=None):
    """TR3 -> TR3 with --tp re-slicing and/or --shared-h, through in-memory packs (exact or refused)."""
    from trellis_cli.repack.run import CONFIG, NOT_COPIED, SourceHashes, _has_experts, source_root, vector_ndim
    from trellis_cli.repack.tr3_output import Tr3Output, Tr3Run, assign_shards

    if options.ranks is not None:
        raise UsageError("--ranks does not apply with --to tr3 (a TR3 shard holds every rank)")
    tp = resolve_target_tp(options.tp, checkpoint.tp)
    inter = checkpoint.intermediate
    rank_pieces(inter, checkpoint.tp, tp, 0)  # refuses an inexpressible --tp before anything is written
    layers = parse_selection(options.layers, [li for li, m in checkpoint.layers.items() if m.experts], "layers")
    shared = options.shared_h or checkpoint.rotation_layout == "shared_h_v1"
    ndim = vector_ndim(checkpoint)
    codebook = next(lin.codebook for m in checkpoint.layers.values() for projs in m.experts.values()
                    for ranks in projs.values() for lin in ranks.values())
    specs = {layer: Tr3Layer(layer, {e: k for k, ids in layer_tiers(checkpoint, layer) for e in ids}, tp,
                             checkpoint.hidden, inter // tp, codebook, shared, ndim["per_expert"], ndim["shared_h"])
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
                and not _has_experts(checkpoint, n)},
        config=_restored_config(dict(checkpoint.config), tp, shared), read_copied=checkpoint.source.read_json,
        source_root=source_root(checkpoint),
        fingerprint={"source": checkpoint.source.describe(), "options": _options(options)})
    hashes = SourceHashes(checkpoint)
    layer_files = {layer: sorted(checkpoint.layers[layer].files) for layer in layers}
    out_plan.sources = lambda shard: hashes.of(_made_from(out_plan, shard, layer_files, {n: n for n in carried}))
    return Tr3Run(out, options, out_plan, on_bytes, on_total, log).run()


def _tr3_shards(entry: dict[str, Any]) -> list[str]:
    """The TR3 shard(s) a pack's layer came from; `tr3_shard` names it for a pack made from exl3-v1."""
    return [entry["tr3_shard"]] if entry.get("tr3_shard") else entry.get("source_files", [])


def _made_from(plan: "Tr3Output", shard: str, layer_files: dict[int, list[str]], carried_from: dict[str, str]):
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


def _options(options) -> dict[str, Any]:
    return {k: getattr(options, k) for k in ("layers", "ranks", "tp", "shared_h", "to")}


def _restored_config(config: dict[str, Any], tp: int, shared: bool) -> dict[str, Any]:
    """The source config (without the repack note), with TP and rotation layout updated only if they changed."""
    from trellis_cli.repack.run import REPACK_NOTE_KEY

    config = {k: v for k, v in config.items() if k != REPACK_NOTE_KEY}
    hybrid = config.get("hybrid_tr3_tail")
    if isinstance(hybrid, dict):
        hybrid = dict(hybrid)
        if hybrid.get("tp") != tp:
            hybrid["tp"] = tp
        was_shared = hybrid.get("rotation_layout") == "shared_h_v1"
        if was_shared != shared:
            hybrid["rotation_layout"] = ROTATION_LAYOUT[shared]
            if shared:
                hybrid["shared_h_tensor_schema"] = SHARED_H_TENSOR_SCHEMA
            else:
                hybrid.pop("shared_h_tensor_schema", None)
        config["hybrid_tr3_tail"] = hybrid
    return config


def _cached_packs(load: Callable[[int], LayerPack]) -> Callable[[int], LayerPack]:
    """Keep only the most recent rank's pack: writing and checking walk the ranks in order."""
    cache: dict[int, LayerPack] = {}

    def get(rank: int) -> LayerPack:
        if rank not in cache:
            cache.clear()
            cache[rank] = load(rank)
        return cache[rank]

    return get
