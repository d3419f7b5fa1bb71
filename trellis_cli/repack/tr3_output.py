"""What a `--to tr3` run writes, decided before any work, and the staged, resumable run that writes it.

Shards keep the source's names: a MoE layer goes to the shard that held it (a layer spread over several
shards goes whole into the first of them, by name), and several layers that shared a shard share it again.
Each shard holds its layers' tensors, then the non-expert tensors its source shard carried, in stored order.
Every other file is copied unchanged; config.json, model.safetensors.index.json and MANIFEST.sha256 are
written anew. When only some MoE layers are written (`--layers`, or a route pack of some layers), the
declarations are narrowed to exactly those: `hybrid_tr3_tail.moe_layers`, `trellis_bits_by_layer` and the
bitmap file, so the result validates as the checkpoint it is.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.declared import TR3_MIXED_K, TR3_UNIFORM_K, layer_range
from trellis_cli.checkpoint.model import TensorRef
from trellis_cli.checkpoint.names import SHARED_H_TENSOR_SCHEMA, shard_name
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header import read_local_header
from trellis_cli.integrity import CHECKSUM_MANIFEST, write_manifest
from trellis_cli.repack import carry
from trellis_cli.routepack import manifest as mf
from trellis_cli.repack.lock import StageLock
from trellis_cli.repack.out_paths import output_path
from trellis_cli.repack.result import REPACK_NOTE_KEY, RepackResult
from trellis_cli.routepack.source_bytes import TensorReader
from trellis_cli.repack.staging import (Stage, announce, check_free_space, check_target, refuse_collisions,
                                        refuse_overlap, stage_path)
from trellis_cli.repack.tr3_shard import check_tr3_shard, write_tr3_shard

INDEX_NAME = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_METADATA = {"format": "pt"}
ROTATION_LAYOUT = {True: "shared_h_v1", False: "per_expert_v1"}


def assign_shards(layer_files: dict[int, list[str]]) -> dict[str, list[int]]:
    """Output shard -> its MoE layers (ascending), from the source shards that held each layer."""
    shards: dict[str, list[int]] = {}
    for layer in sorted(layer_files):
        files = sorted(layer_files[layer])
        shards.setdefault(files[0] if files else shard_name(layer), []).append(layer)
    return shards


@dataclass
class Tr3Output:
    specs: dict[int, Any]  # layer -> tr3_shard.Tr3Layer
    packs: Callable[[int, int], Any]  # (layer, rank) -> LayerPack
    shards: dict[str, list[int]]  # output shard -> its MoE layers
    carried: dict[str, list[TensorRef]]  # output shard -> non-expert tensors written after its layers
    carried_source: Any  # the Source the carried refs are read from
    metadata: dict[str, dict[str, str]]  # shard -> the __metadata__ its source had
    copied: dict[str, Path]  # written unchanged
    config: dict[str, Any]
    read_copied: Callable[[str], Any]  # the JSON of a copied file (to narrow the bitmap)
    source_root: Path | list[Path] | None  # what OUT may not overlap (source_facts.protected_paths)
    fingerprint: dict[str, Any]
    sources: Callable[[str], dict[str, str]] = lambda _shard: {}  # shard -> sha256 of the files it is made from
    rewritten: dict[str, str] = field(default_factory=dict)  # name -> text, instead of a copy
    # (name, the copy written) -> refuse a copy that does not hash to the source's own recorded hash
    check_copy: Callable[[str, Path], None] = lambda _name, _copy: None
    # the staged tree -> refuse an output the TR3 validator refuses (conversions from other formats)
    final_check: Callable[[Path], None] = lambda _tree: None

    def all_shards(self) -> list[str]:
        return sorted(set(self.shards) | set(self.carried))

    def narrow_declarations(self) -> None:
        """Declare exactly the MoE layers written; a set that is not one range cannot be declared: refused."""
        hybrid = self.config.get("hybrid_tr3_tail")
        if not isinstance(hybrid, dict):
            return
        written = sorted(self.specs)
        if set(layer_range(hybrid.get("moe_layers"))) == set(written):
            return
        if written != list(range(written[0], written[-1] + 1)):
            raise UsageError(f"MoE layers {written}: a TR3 checkpoint declares its MoE layers as one range "
                             f"(hybrid_tr3_tail.moe_layers [first, last]); select a contiguous range of layers")
        hybrid = dict(hybrid, moe_layers=[written[0], written[-1]])
        if isinstance(hybrid.get("trellis_bits_by_layer"), dict):
            hybrid["trellis_bits_by_layer"] = {k: v for k, v in hybrid["trellis_bits_by_layer"].items()
                                               if not k.isdecimal() or int(k) in self.specs}
        self.config = dict(self.config, hybrid_tr3_tail=hybrid)
        ref = hybrid.get("bits_per_expert")
        bitmap = ref.rsplit(":", 1)[0] if isinstance(ref, str) and ":" in ref else None
        if bitmap in self.copied:
            doc = self.read_copied(bitmap)
            if isinstance(doc, dict):
                kept = {k: v for k, v in doc.items() if not (k.isdecimal() and int(k) not in self.specs)}
                self.rewritten[bitmap] = json.dumps(kept, indent=2) + "\n"
                del self.copied[bitmap]

    def refuse_unrepresentable(self) -> None:
        """Refuse, before any work, K that a TR3 config cannot declare: its validator and loaders would refuse
        the output (exl3-v1 and route packs also hold mcg K2, which TR3 does not)."""
        used = {k for spec in self.specs.values() for k in spec.expert_k.values()}
        allowed, how = ((TR3_UNIFORM_K, "one K for every expert: 3, 4, 5, 6 or 8") if len(used) == 1 else
                        (TR3_MIXED_K, "mixed K within 3..6"))
        bad = sorted(k for k in used if k not in allowed)
        if bad:
            layer, expert = next((li, e) for li, spec in sorted(self.specs.items())
                                 for e, k in sorted(spec.expert_k.items()) if k == bad[0])
            raise UsageError(f"--to tr3: layer {layer} expert {expert} is K{bad[0]} (K used: {sorted(used)}); a TR3 "
                             f"checkpoint declares {how}, so its validator and loaders would refuse the output; "
                             f"refusing before any work (keep this checkpoint's format)")

    def refuse_collisions(self) -> None:
        claims = [(CONFIG, "the TR3 config.json"), (INDEX_NAME, "the TR3 index"), (CHECKSUM_MANIFEST, "the TR3 MANIFEST.sha256")]
        for shard in self.all_shards():
            layers = self.shards.get(shard, [])
            claims.append((shard, f"the TR3 shard of layers {layers}" if layers else f"the non-expert tensors of "
                                  f"source file {shard}"))
        claims += [(name, f"source file {name}") for name in [*self.copied, *self.rewritten]]
        refuse_collisions(claims, self.all_shards())

    def shard_tensors(self, shard: str) -> list:
        return [t for layer in self.shards.get(shard, []) for t, _ in self.specs[layer].slots()] + \
            carry.planned(self.carried.get(shard, []))

    def bytes_to_write(self) -> int:
        """Every byte of the output: shards (headers included), copied and rewritten files, config."""
        shards = sum(carry.file_bytes(self.shard_tensors(s), self.metadata.get(s, DEFAULT_METADATA))
                     for s in self.all_shards())
        copied = sum(path.stat().st_size for path in self.copied.values())
        return shards + copied + sum(len(t.encode()) for t in self.rewritten.values())


class Tr3Run:
    """Staged, resumable writing of TR3 shards plus the JSON and copied files around them."""

    def __init__(self, out: Path, options, plan: Tr3Output, on_bytes, on_total, log) -> None:
        self.out, self.opt, self.plan = out, options, plan
        self.on_bytes = on_bytes or (lambda _n: None)
        self.on_total = on_total or (lambda _n: None)
        self.log = log or (lambda _m: None)

    def run(self):
        start = time.perf_counter()
        self.plan.refuse_unrepresentable()
        self.plan.narrow_declarations()
        self.plan.refuse_collisions()
        result = RepackResult(self.out)
        refuse_overlap(self.out, self.plan.source_root)
        with StageLock(stage_path(self.out), self.out):
            check_target(self.out, self.plan.source_root, self.opt.overwrite)
            stage = Stage(self.out, self.plan.fingerprint, self.opt.overwrite)
            announce(stage, self.log)
            result.bytes_needed = self.plan.bytes_to_write()
            try:
                check_free_space(self.out, result.bytes_needed - stage.bytes_done())
            except CheckFailed:
                stage.discard_if_new()
                raise
            self.on_total(result.bytes_needed)
            with stage.discard_on_refusal():
                self._write_all(stage, result)
                self.plan.final_check(stage.path)
            stage.move_into_place()
        result.seconds = time.perf_counter() - start
        return result

    def _write_all(self, stage: Stage, result) -> None:
        plan = self.plan
        weight_map: dict[str, str] = {}
        with TensorReader(plan.carried_source) as reader:
            for shard in plan.all_shards():
                specs = [plan.specs[layer] for layer in plan.shards.get(shard, [])]
                carried = plan.carried.get(shard, [])
                sources = plan.sources(shard)
                path = output_path(stage.path, shard, f"the TR3 shard of layers {plan.shards.get(shard, [])}")
                if stage.completed(shard, sources):
                    result.files_resumed += 1
                    self.on_bytes(path.stat().st_size)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_tr3_shard(path, specs, plan.packs, carried, reader, plan.metadata.get(shard, DEFAULT_METADATA),
                                    self.on_bytes)
                    check_tr3_shard(path, specs, plan.packs, carried, reader)
                    stage.record(shard, mf.file_entry(path), sources)
                    result.files_written += 1
                    result.bytes_written += path.stat().st_size
                weight_map.update(dict.fromkeys((t.name for t in plan.shard_tensors(shard)), shard))
        self._write_rest(stage, weight_map)

    def _write_rest(self, stage: Stage, weight_map: dict[str, str]) -> None:
        for name, path in self.plan.copied.items():
            target = output_path(stage.path, name, f"source file {name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            self.plan.check_copy(name, target)
            if name.endswith(".safetensors"):
                weight_map.update(dict.fromkeys(read_local_header(target, name).tensors, name))
        for name, text in self.plan.rewritten.items():
            target = output_path(stage.path, name, f"the rewritten {name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        (stage.path / CONFIG).write_text(json.dumps(self.plan.config, indent=2) + "\n", encoding="utf-8")
        # total_size counts tensor data bytes, not file sizes (the index convention validate checks).
        total = sum(entry.nbytes for f in set(weight_map.values())
                    for entry in read_local_header(stage.path / f, f).tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (stage.path / INDEX_NAME).write_text(json.dumps(index, separators=(",", ":")), encoding="utf-8")
        # Every file of the output, nested shard folders included (as the source may have them).
        names = (p.relative_to(stage.path).as_posix() for p in stage.path.rglob("*") if p.is_file())
        write_manifest(stage.path, sorted(n for n in names if n != CHECKSUM_MANIFEST))


def fingerprint_options(options) -> dict[str, Any]:
    return {k: getattr(options, k) for k in ("layers", "ranks", "tp", "shared_h", "to")}


def restored_config(config: dict[str, Any], tp: int, shared: bool) -> dict[str, Any]:
    """The source config (without the repack note), with TP and rotation layout updated only if they changed."""
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
