"""What a TR3 output holds and how it is laid out: the writer of `repack --to tr3`.

Shards keep the source's names: a MoE layer goes to the shard that held it (a layer spread over several
shards goes whole into the first of them, by name), and several layers that shared a shard share it again.
Each shard holds its layers' tensors (shard.py), then the non-expert tensors its source shard carried, in
stored order. Every other file is copied unchanged; config.json, model.safetensors.index.json and
MANIFEST.sha256 are written anew. When only some MoE layers are written (`--layers`, or a route pack of some
layers), the declarations are narrowed to exactly those: `hybrid_tr3_tail.moe_layers`, `trellis_bits_by_layer`
and the bitmap file, so the result validates as the checkpoint it is.

Where the files go is the StagedOutput repack hands in (dialects/tr3/driver.py: staging, lock, resume); which
files, tensors and declarations they hold is decided here.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.declared import layer_range
from trellis_cli.checkpoint.model import TensorRef
from trellis_cli.checkpoint.names import SHARED_H_TENSOR_SCHEMA, shard_name
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.dialects.routepack.write import REPACK_NOTE_KEY
from trellis_cli.dialects.tr3.declared import TR3_MIXED_K, TR3_UNIFORM_K
from trellis_cli.dialects.tr3.shard import check_tr3_shard, write_tr3_shard
from trellis_cli.errors import UsageError
from trellis_cli.header import read_local_header
from trellis_cli.integrity import CHECKSUM_MANIFEST, write_manifest
from trellis_cli.dialects import carry
from trellis_cli.checkpoint.tensor_bytes import TensorReader
from trellis_cli.sources import Source

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
    specs: dict[int, Any]  # layer -> shard.Tr3Layer
    packs: Callable[[int, int], Any]  # (layer, rank) -> LayerPack
    shards: dict[str, list[int]]  # output shard -> its MoE layers
    carried: dict[str, list[TensorRef]]  # output shard -> non-expert tensors written after its layers
    carried_source: Source  # the Source the carried refs are read from
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

    def claims(self) -> list[tuple[str, str]]:
        """Every name this output writes, with what it is (repack refuses two claims on one name)."""
        claims = [(CONFIG, "the TR3 config.json"), (INDEX_NAME, "the TR3 index"),
                  (CHECKSUM_MANIFEST, "the TR3 MANIFEST.sha256")]
        for shard in self.all_shards():
            layers = self.shards.get(shard, [])
            claims.append((shard, f"the TR3 shard of layers {layers}" if layers else f"the non-expert tensors of "
                                  f"source file {shard}"))
        claims += [(name, f"source file {name}") for name in [*self.copied, *self.rewritten]]
        return claims

    def shard_tensors(self, shard: str) -> list:
        return [t for layer in self.shards.get(shard, []) for t, _ in self.specs[layer].slots()] + \
            carry.planned(self.carried.get(shard, []))

    def bytes_to_write(self) -> int:
        """Every byte of the output: shards (headers included), copied and rewritten files, config."""
        shards = sum(carry.file_bytes(self.shard_tensors(s), self.metadata.get(s, DEFAULT_METADATA))
                     for s in self.all_shards())
        copied = sum(path.stat().st_size for path in self.copied.values())
        return shards + copied + sum(len(t.encode()) for t in self.rewritten.values())

    def shard_path(self, staged: StagedOutput, shard: str) -> Path:
        return staged.file(shard, f"the TR3 shard of layers {self.shards.get(shard, [])}")

    def write_shard(self, staged: StagedOutput, shard: str, reader: TensorReader,
                    on_bytes: Callable[[int], None]) -> Path:
        """Write one shard into the staged tree and read it back against the packs and carried sources."""
        specs = [self.specs[layer] for layer in self.shards.get(shard, [])]
        carried = self.carried.get(shard, [])
        path = self.shard_path(staged, shard)
        write_tr3_shard(path, specs, self.packs, carried, reader, self.metadata.get(shard, DEFAULT_METADATA),
                        on_bytes)
        check_tr3_shard(path, specs, self.packs, carried, reader)
        return path

    def write_rest(self, staged: StagedOutput, weight_map: dict[str, str]) -> None:
        """Copied and rewritten files, config.json, the index (`weight_map`: the shards' tensors so far) and
        MANIFEST.sha256 of every file, once the shards are in the tree."""
        for name, path in self.copied.items():
            target = staged.file(name, f"source file {name}")
            shutil.copyfile(path, target)
            self.check_copy(name, target)
            if name.endswith(".safetensors"):
                weight_map.update(dict.fromkeys(read_local_header(target, name).tensors, name))
        for name, text in self.rewritten.items():
            staged.file(name, f"the rewritten {name}").write_text(text, encoding="utf-8")
        tree = staged.path
        (tree / CONFIG).write_text(json.dumps(self.config, indent=2) + "\n", encoding="utf-8")
        # total_size counts tensor data bytes, not file sizes (the index convention validate checks).
        total = sum(entry.nbytes for f in set(weight_map.values())
                    for entry in read_local_header(tree / f, f).tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tree / INDEX_NAME).write_text(json.dumps(index, separators=(",", ":")), encoding="utf-8")
        # Every file of the output, nested shard folders included (as the source may have them).
        names = (p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
        write_manifest(tree, sorted(n for n in names if n != CHECKSUM_MANIFEST))


def restored_config(config: dict[str, Any], tp: int, shared: bool) -> dict[str, Any]:
    """The source config (without a route pack's note), with TP and rotation layout updated only if they changed."""
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
