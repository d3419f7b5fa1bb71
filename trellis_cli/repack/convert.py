"""Conversions that write the TR3 layout (`--to tr3`): from a route pack, or from TR3 with --tp/--shared-h.

A TR3 shard holds every rank of one layer; it is written rank by rank from one LayerPack at a time (the
header is planned first), so memory stays at one layer-rank. Tensor names follow the TR3 schema, vectors
get back the shape the source stored ([n] or [1, n], recorded in the manifest), and codebook markers are
rewritten from the codebook. After each shard is written it is read back and compared bit for bit with
the packs it came from; nothing is ever rounded, so a conversion either is exact or is refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import MCG_MARKER, MUL1_MARKER, PROJECTIONS, Checkpoint
from trellis_cli.checkpoint.names import H_SIDE, I_SIDE, SHARED_H_TENSOR_SCHEMA, expert_key, shard_name, shared_h_key
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header import read_local_header
from trellis_cli.integrity import MANIFEST, write_manifest
from trellis_cli.repack import manifest as mf
from trellis_cli.id_ranges import expand_ranges
from trellis_cli.repack.format import LayerPack, split_descriptor
from trellis_cli.repack.layer_file import read_layer_pack
from trellis_cli.repack.pack import layer_tiers, pack_layer
from trellis_cli.repack.plan import parse_selection, rank_pieces, resolve_target_tp
from trellis_cli.repack.readback import same_bits
from trellis_cli.repack.staging import Stage, check_free_space, check_target
from trellis_cli.sources import LocalSource
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter

MARKERS = {"mcg": ("mcg", MCG_MARKER), "mul1": ("mul1", MUL1_MARKER), "3inst": None}
ROTATION_LAYOUT = {True: "shared_h_v1", False: "per_expert_v1"}
INDEX_NAME = "model.safetensors.index.json"


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


def write_tr3_layer(path: Path, spec: Tr3Layer, packs: Callable[[int], LayerPack], extra=None,
                    on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Write one TR3 shard, one rank's pack in memory at a time; `extra` = [(PlannedTensor, tensor)] appended."""
    slots = spec.slots()
    extra = extra or []
    plan = [t for t, _ in slots] + [t for t, _ in extra]
    with SafetensorsWriter(path, plan, {"format": "pt"}) as writer:
        rank, pack = None, None
        for planned, origin in slots:
            if origin[1] != rank:
                rank, pack = origin[1], packs(origin[1])
            writer.write(planned.name, tensor_from_pack(spec, pack, planned, origin))
            if on_bytes is not None:
                on_bytes(planned.nbytes)
        for planned, tensor in extra:
            writer.write(planned.name, tensor)
    return [t.name for t in plan]


def check_tr3_layer(path: Path, spec: Tr3Layer, packs: Callable[[int], LayerPack], extra=None) -> None:
    """Read the shard back through safetensors and compare every tensor with the packs, bit for bit."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        rank, pack = None, None
        for planned, origin in spec.slots():
            if origin[1] != rank:
                rank, pack = origin[1], packs(origin[1])
            if not same_bits(f.get_tensor(planned.name), tensor_from_pack(spec, pack, planned, origin)):
                raise CheckFailed(f"{path.name}: {planned.name}: read back differs from the route pack")
        for planned, tensor in extra or []:
            if not same_bits(f.get_tensor(planned.name), tensor):
                raise CheckFailed(f"{path.name}: {planned.name}: read back differs from the source")


# ---- the two drivers ------------------------------------------------------------------------------------

def route_pack_to_tr3(root: Path, out: Path, options, *, on_bytes=None, on_total=None, log=None):
    """A route-pack directory -> the TR3 layout (config, bitmap and other files restored, shards rebuilt)."""
    from trellis_cli.repack.verify import verify_repacked

    if options.to != "tr3":
        raise UsageError(f"{root} is already a route pack; pass --to tr3 to convert it back to TR3")
    if options.tp is not None or options.ranks is not None:
        raise UsageError("--tp and --ranks apply when reading a TR3 checkpoint; repack the TR3 source instead")
    # Verification also checks every key and name of the manifest, so what follows can index it freely and
    # every name it joins onto OUT stays inside OUT.
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
    run = _Tr3Run(out, options, specs, lambda layer, rank: read_layer_pack(root, layer, rank), on_bytes, on_total, log)
    run.shard_names = {layer: doc["layers"][str(layer)].get("tr3_shard") or _shard_name(  # tr3_shard: from exl3-v1
        doc["layers"][str(layer)].get("source_files"), layer) for layer in layers}
    run.config = _restored_config(_pack_config(root), tp, shared)
    run.copy_from = {n: root / n for n, e in doc["files"].items() if e.get("role") == "copied"}
    run.extra_from = {e["source_file"]: root / n for n, e in doc["files"].items() if e.get("role") == "extra"}
    run.source_root = root
    return run.run(fingerprint={"source": str(root.resolve()), "manifest": doc.get("manifest_sha256"),
                                "options": _options(options)})


def tr3_to_tr3(checkpoint: Checkpoint, out: Path, options, *, on_bytes=None, on_total=None, log=None):
    """TR3 -> TR3 with --tp re-slicing and/or --shared-h, through in-memory packs (exact or refused)."""
    from trellis_cli.repack.run import other_tensor_files, source_root, vector_ndim

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
    packs = lambda layer, rank: pack_layer(checkpoint, layer, rank, tp=tp,  # noqa: E731
                                           shared_h=True if options.shared_h else None)
    run = _Tr3Run(out, options, specs, packs, on_bytes, on_total, log)
    run.shard_names = {layer: _shard_name(sorted(checkpoint.layers[layer].files), layer) for layer in layers}
    run.config = _restored_config(dict(checkpoint.config), tp, shared)
    root = source_root(checkpoint)
    run.source_root = root
    run.extra_names = other_tensor_files(checkpoint)
    expert_files = {f for m in checkpoint.layers.values() for f in m.files}
    run.copy_from = {n: checkpoint.source.local_path(n) for n in checkpoint.files
                     if not n.endswith(".index.json") and n not in ("config.json", "MANIFEST.sha256")
                     and (not n.endswith(".safetensors") or n not in expert_files)}
    run.extra_checkpoint = checkpoint
    return run.run(fingerprint={"source": checkpoint.source.describe(), "options": _options(options)})


def _pack_config(root: Path) -> dict[str, Any]:
    """The route pack's config.json (verified against the manifest's hash, but still any JSON)."""
    config = LocalSource(root).read_json("config.json")
    if not isinstance(config, dict):
        raise CheckFailed(f"{root / 'config.json'}: a JSON {type(config).__name__}, expected an object")
    return config


def _options(options) -> dict[str, Any]:
    return {k: getattr(options, k) for k in ("layers", "ranks", "tp", "shared_h", "to")}


def _shard_name(source_files, layer: int) -> str:
    if source_files and len(source_files) == 1:
        return source_files[0]
    return shard_name(layer)


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


class _Tr3Run:
    """Staged, resumable writing of TR3 shards plus the JSON and copied files around them."""

    def __init__(self, out: Path, options, specs: dict[int, Tr3Layer], packs, on_bytes, on_total, log) -> None:
        self.out, self.opt, self.specs, self.packs = out, options, specs, packs
        self.on_bytes = on_bytes or (lambda _n: None)
        self.on_total = on_total or (lambda _n: None)
        self.log = log or (lambda _m: None)
        self.shard_names: dict[int, str] = {}
        self.config: dict[str, Any] = {}
        self.copy_from: dict[str, Path] = {}
        self.extra_from: dict[str, Path] = {}  # original shard name -> extra/<name> file of a route pack
        self.extra_checkpoint: Checkpoint | None = None
        self.extra_names: dict[str, list[str]] = {}
        self.source_root: Path | None = None

    def run(self, fingerprint: dict[str, Any]):
        from trellis_cli.repack.run import RepackResult

        start = time.perf_counter()
        check_target(self.out, self.source_root, self.opt.overwrite)
        stage = Stage(self.out, fingerprint, self.opt.overwrite)
        total = sum(t.nbytes for spec in self.specs.values() for t, _ in spec.slots())
        try:
            check_free_space(self.out, total - stage.bytes_done())
        except CheckFailed:
            if not stage.resumed:
                import shutil

                shutil.rmtree(stage.path, ignore_errors=True)
            raise
        self.on_total(total)
        result = RepackResult(self.out)
        with stage.discard_on_refusal():
            self._write_all(stage, result)
        stage.move_into_place()
        result.seconds = time.perf_counter() - start
        return result

    def _write_all(self, stage: Stage, result) -> None:
        weight_map: dict[str, str] = {}
        for layer, spec in self.specs.items():
            name = self.shard_names[layer]
            extra = self._extra(name)
            if stage.completed(name):
                result.files_resumed += 1
                names = [t.name for t, _ in spec.slots()] + [t.name for t, _ in extra]
            else:
                packs = _cached_packs(lambda rank, layer=layer: self.packs(layer, rank))
                (stage.path / name).parent.mkdir(parents=True, exist_ok=True)
                names = write_tr3_layer(stage.path / name, spec, packs, extra, self.on_bytes)
                check_tr3_layer(stage.path / name, spec, packs, extra)
                stage.record(name, mf.file_entry(stage.path / name))
                result.files_written += 1
                result.bytes_written += (stage.path / name).stat().st_size
            weight_map.update(dict.fromkeys(names, name))
        self._write_rest(stage, weight_map)

    def _extra(self, shard: str) -> list:
        """Non-expert tensors that belong in this shard (carried through by the route pack)."""
        from safetensors import safe_open

        from trellis_cli.stwriter import planned

        if shard in self.extra_from:
            with safe_open(str(self.extra_from[shard]), framework="pt") as f:
                return [(planned(n, f.get_tensor(n)), f.get_tensor(n)) for n in f.keys()]
        if self.extra_checkpoint is not None and shard in self.extra_names:
            from trellis_cli.repack.run import _read_from
            from trellis_cli.repack.source_bytes import TensorReader

            with TensorReader(self.extra_checkpoint.source) as reader:
                tensors = [(n, _read_from(reader, self.extra_checkpoint, shard, n)) for n in self.extra_names[shard]]
            return [(planned(n, t), t) for n, t in tensors]
        return []

    def _write_rest(self, stage: Stage, weight_map: dict[str, str]) -> None:
        import shutil

        for name, path in self.copy_from.items():
            (stage.path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, stage.path / name)
        shards = set(self.shard_names.values())
        for shard, path in self.extra_from.items():  # extras whose shard held no experts we rebuilt
            if shard not in shards:
                (stage.path / shard).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, stage.path / shard)
                self.copy_from[shard] = path
        for name in self.copy_from:
            if name.endswith(".safetensors"):
                weight_map.update(dict.fromkeys(read_local_header(stage.path / name, name).tensors, name))
        (stage.path / "config.json").write_text(json.dumps(self.config, indent=2) + "\n", encoding="utf-8")
        # total_size counts tensor data bytes, not file sizes (the index convention validate checks).
        total = sum(entry.nbytes for f in set(weight_map.values())
                    for entry in read_local_header(stage.path / f, f).tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (stage.path / INDEX_NAME).write_text(json.dumps(index, separators=(",", ":")), encoding="utf-8")
        # Every file of the output, nested shard folders included (as the source may have them).
        names = (p.relative_to(stage.path) for p in stage.path.rglob("*") if p.is_file())
        write_manifest(stage.path, sorted(n.as_posix() for n in names
                                          if not any(part.startswith(".") for part in n.parts) and str(n) != MANIFEST))


def _cached_packs(load: Callable[[int], LayerPack]) -> Callable[[int], LayerPack]:
    """Keep only the most recent rank's pack: writing and checking walk the ranks in order."""
    cache: dict[int, LayerPack] = {}

    def get(rank: int) -> LayerPack:
        if rank not in cache:
            cache.clear()
            cache[rank] = load(rank)
        return cache[rank]

    return get
