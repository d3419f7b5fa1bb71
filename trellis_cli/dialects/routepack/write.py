"""What a route-pack output holds besides its layer files (dialects/routepack/layer_file.py writes those): the
config.json with the repack note, the copied files and the extra/ files of carried non-expert tensors, each
layer's manifest entry, and manifest.json written last. The writer of `repack` into a route pack, from TR3
(dialects/routepack/tr3_to_route_pack.py) or from exl3-v1 (dialects/exl3v1/exl3v1_to_route_pack.py), handed the staged tree by repack.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import TensorRef
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.errors import UsageError
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME, SCHEMA, SCHEMA_VERSION
from trellis_cli.id_ranges import compact_ranges
from trellis_cli.dialects import carry
from trellis_cli.dialects.routepack import manifest as mf
from trellis_cli.dialects.routepack.layer_file import sync_file
from trellis_cli.checkpoint.tensor_bytes import TensorReader
from trellis_cli.sources import Source

CONFIG = "config.json"
REPACK_NOTE_KEY = "trellis_repack"  # config.json's note that the routed experts are in a route pack
EXTRA_DIR = "extra"  # extra/<shard>: the non-expert tensors of a source shard that held routed experts
LAYER_FILE_NAME = re.compile(r"layer-[0-9]+-rank-[0-9]+\.safetensors")  # reserved: no copied file may take one


def repack_note(tp: int, rotation: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "manifest": "manifest.json", "tp": tp,
            "rotation": rotation,
            "note": "routed experts are stored in the route-pack layout (one file per MoE layer and rank, listed "
                    "in manifest.json); `trellis repack OUT DEST --to tr3` restores the TR3 layout"}


def claims(layer_files: list[tuple[str, int, int]], carried: list[str], copied: list[str]) -> list[tuple[str, str]]:
    """Every name a route pack writes, with what it is: manifest, config, one layer file per (file, layer,
    rank), the extra/ file of each source file whose non-expert tensors are `carried`, the `copied` files.
    Repack refuses two claims on one name."""
    out = [(MANIFEST_NAME, "the route pack's manifest.json"), (CONFIG, "the route pack's config.json")]
    out += [(file, f"the layer file of layer {layer} rank {rank}") for file, layer, rank in layer_files]
    out += [(f"{EXTRA_DIR}/{name}", f"the non-expert tensors of source file {name}") for name in carried]
    return out + [(name, f"source file {name}") for name in copied]


def refuse_reserved(copied: list[str]) -> None:
    """A copied source file may not take a layer file's name, a name the route pack reserves."""
    for name in copied:
        if LAYER_FILE_NAME.fullmatch(name):
            raise UsageError(f"source file {name} is named like a route-pack layer file, a name the route pack "
                             f"reserves; refusing before any work (rename or remove the source file)")


def write_config(staged: StagedOutput, config: dict[str, Any], tp: int, rotation: str) -> dict[str, Any]:
    """config.json: the source's, with the repack note; returns its manifest entry."""
    config = dict(config)
    config[REPACK_NOTE_KEY] = repack_note(tp, rotation)
    (staged.path / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return mf.file_entry(staged.path / CONFIG, role="config")


def source_record(source: Source, dialect: str, rotation_layout: str, tp: int, vector_ndim: dict[str, int],
                  files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's `source`: where the pack came from (a local path made absolute) and its files' hashes."""
    record: dict[str, Any] = dict(source.describe())  # a copy, which the manifest's keys extend
    if record.get("kind") == "local" and record.get("path"):
        record["path"] = str(Path(record["path"]).resolve())
    record.update({"dialect": dialect, "rotation_layout": rotation_layout, "tp": tp, "vector_ndim": vector_ndim,
                   "files": files})
    return record


def layer_entry(tiers: list[tuple[int, list[int]]], source_files: list[str],
                tr3_shard: str | None = None) -> dict[str, Any]:
    """One MoE layer in the manifest: its tiers, the source files it came from, and (from exl3-v1) the TR3 shard
    `--to tr3` writes it back into."""
    entry: dict[str, Any] = {"tiers": [{"k": k, "size": len(ids), "experts": compact_ranges(ids)} for k, ids in tiers],
                             "source_files": source_files}
    if tr3_shard is not None:
        entry["tr3_shard"] = tr3_shard
    return entry


def copy_files(staged: StagedOutput, copies: dict[str, Path], check: Callable[[str, Path], None]) -> dict[str, Any]:
    """Source files copied byte for byte (`check` refuses a copy that is not the source's); their entries."""
    entries = {}
    for name, path in copies.items():
        target = staged.file(name, f"source file {name}")
        shutil.copyfile(path, target)
        check(name, target)
        entries[name] = mf.file_entry(target, role="copied")
    return entries


def write_json_files(staged: StagedOutput, docs: dict[str, Any]) -> dict[str, Any]:
    """JSON documents written next to config.json, listed as copied files (what `--to tr3` carries)."""
    entries = {}
    for name, doc in docs.items():
        target = staged.file(name, "output file")
        target.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        entries[name] = mf.file_entry(target, role="copied")
    return entries


def write_extras(staged: StagedOutput, carried: dict[str, list[TensorRef]], reader: TensorReader,
                 metadata: dict[str, dict[str, str]]) -> dict[str, Any]:
    """extra/<file>: the non-expert tensors of each source file that also held routed experts, read back."""
    entries = {}
    for name, refs in carried.items():
        extra = staged.file(f"{EXTRA_DIR}/{name}", f"the non-expert tensors of {name}")
        carry.write_subset(extra, refs, reader, metadata[name])
        entries[f"{EXTRA_DIR}/{name}"] = mf.file_entry(extra, role="extra", source_file=name)
    return entries


def write_manifest(staged: StagedOutput, doc: dict[str, Any], files: dict[str, dict[str, Any]],
                   layer_files: list[str]) -> dict[str, Any]:
    """manifest.json, last: `doc` with every file's entry, after the layer files are synced to disk."""
    doc["files"] = dict(sorted(files.items()))
    for name in layer_files:
        sync_file(staged.path / name)
    mf.write_manifest(staged.path, doc)
    return doc
