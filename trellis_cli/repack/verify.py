"""Validate and describe a repacked (route-pack) directory: `verify_repacked`, `describe_repacked`.

Needs no source checkpoint: the manifest states every file's sha256 and size, and each layer file must be
self-consistent (tier K ascending and matching the slab shapes, tier sizes <= 256, descriptors equal to
(tier << 8) | local id in combined order, global_to_combined a bijection onto the combined ids, rotation
tables shaped for the geometry). Every problem is a finding with a stable `repack.*` code.

The manifest is untrusted input: its structure, types and file names are checked first (`manifest_findings`),
and nothing after that reads a key or opens a name it has not vouched for.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trellis_cli.errors import CheckFailed
from trellis_cli.findings import Location, Report, error, warning
from trellis_cli.header import HeaderError, is_int, read_local_header
from trellis_cli.id_ranges import expand_ranges, range_bounds
from trellis_cli.repack import manifest as mf
from trellis_cli.repack.format import (
    CODEBOOK_IDS, DESCRIPTORS, GLOBAL_TO_COMBINED, MANIFEST_NAME, MAX_TIER_EXPERTS, ROT_DOWN_SVH, ROT_GATE_SUH,
    ROT_INTERMEDIATE, ROT_UP_SUH, ROTATIONS, SCHEMA, SCHEMA_VERSION, TABLE_NAMES, TIER_K, TIER_SIZE, descriptor,
    layer_file_name, tier_trellis_name, tier_trellis_shape,
)
from trellis_cli.sources import LocalSource
from trellis_cli.validate.rules_files import check_shard

REQUIRED_KEYS = ("schema", "schema_version", "source", "geometry", "tp", "ranks", "codebook", "rotation", "layers",
                 "files")
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,8}")  # as str(layer) writes it; bounded, so int() stays cheap
FILE_ROLES = ("config", "copied", "extra")
CONFIG_NAME = "config.json"
TABLE_DTYPES = {GLOBAL_TO_COMBINED: "I32", DESCRIPTORS: "I32", TIER_K: "I32", TIER_SIZE: "I32",
                ROT_INTERMEDIATE: "F16", ROT_GATE_SUH: "F16", ROT_UP_SUH: "F16", ROT_DOWN_SVH: "F16"}


def repacked_root(source: Any) -> Path:
    """A directory from a path, a LocalSource, or a Checkpoint opened on one."""
    if isinstance(source, (str, Path)):
        return Path(source)
    if hasattr(source, "dialect") and hasattr(source, "source"):
        source = source.source
    return Path(source.root)


def verify_repacked(source: Any, *, check_hashes: bool = True) -> Report:
    """Check schema, file hashes and sizes against the manifest, and every layer file's consistency."""
    root = repacked_root(source)
    report = Report(subject=f"route pack {root}")
    try:
        doc, problems = mf.read_manifest(root)
    except CheckFailed as e:
        code = "repack.manifest-missing" if not (root / MANIFEST_NAME).exists() else "repack.manifest-json"
        report.findings.append(error(code, Location(file=MANIFEST_NAME), str(e)))
        return report
    report.count("files")
    for problem in problems:
        report.findings.append(error("repack.manifest-integrity", Location(file=MANIFEST_NAME), problem))
    if not _check_schema(doc, report):
        return report
    report.context.update({"schema": doc["schema"], "schema_version": doc["schema_version"],
                           "source": _source_label(doc["source"])})
    _check_files(root, doc, report, check_hashes)
    for layer, entry in sorted(doc["layers"].items(), key=lambda kv: int(kv[0])):
        for rank in doc["ranks"]:
            _check_layer_file(root, doc, int(layer), rank, entry, report)
    return report


def _source_label(source: dict[str, Any]) -> str:
    where = source.get("repo_id") or source.get("path") or "?"
    return f"{where}@{source['revision']}" if source.get("revision") else str(where)


def _check_schema(doc: dict[str, Any], report: Report) -> bool:
    where = Location(file=MANIFEST_NAME)
    if doc.get("schema") != SCHEMA:
        report.findings.append(error("repack.schema", where, "not a route-pack manifest", SCHEMA, doc.get("schema")))
        return False
    if doc.get("schema_version") != SCHEMA_VERSION:
        report.findings.append(error("repack.schema-version", where, "unknown schema version", SCHEMA_VERSION,
                                     doc.get("schema_version")))
        return False
    structure = manifest_findings(doc)
    report.extend(structure)
    return not structure


def manifest_findings(doc: dict[str, Any]) -> list:
    """Every key the readers use, with the type and range they rely on; names must stay inside the pack.

    Checked once, before anything else reads the manifest, so the rest of the code can index it freely.
    """
    return _ManifestShape(doc).run()


class _ManifestShape:
    """Structure and types of a schema-1 manifest; collects `repack.manifest-field` and `path.escape` findings."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.findings: list = []

    def bad(self, key: str, expected: str, found: Any) -> None:
        self.findings.append(error("repack.manifest-field", Location(file=MANIFEST_NAME), f"{key}: wrong type or "
                                   "value", expected, _shown(found)))

    def escape(self, key: str, name: Any) -> None:
        self.findings.append(error("path.escape", Location(file=MANIFEST_NAME), f"{key}: names a path outside the "
                                   "route pack", "a relative path inside the directory", _shown(name)))

    def run(self) -> list:
        doc = self.doc
        missing = [k for k in REQUIRED_KEYS if k not in doc]
        if missing:
            self.bad(missing[0], "present", "absent")
            return self.findings
        if isinstance(doc["geometry"], dict):
            for key in ("hidden", "intermediate_rank", "num_experts"):
                self._positive_int(f"geometry.{key}", doc["geometry"].get(key))
        else:
            self.bad("geometry", "an object", doc["geometry"])
        self._positive_int("tp", doc["tp"])
        for key, allowed in (("codebook", sorted(CODEBOOK_IDS)), ("rotation", list(ROTATIONS))):
            if doc[key] not in allowed:
                self.bad(key, f"one of {allowed}", doc[key])
        self._source(doc["source"])
        if self.findings:
            return self.findings  # ranks, layers and files are checked against tp and geometry
        self._ranks(doc["ranks"])
        self._layers(doc["layers"])
        self._files(doc["files"])
        return self.findings

    def _positive_int(self, key: str, value: Any, limit: int | None = None) -> bool:
        if not is_int(value) or value < 1 or (limit is not None and value > limit):
            self.bad(key, "an integer >= 1" if limit is None else f"an integer 1..{limit}", value)
            return False
        return True

    def _source(self, source: Any) -> None:
        if not isinstance(source, dict):
            self.bad("source", "an object", source)
            return
        ndim = source.get("vector_ndim", {})
        if not isinstance(ndim, dict) or any(ndim.get(k, 1) not in (1, 2) for k in ("per_expert", "shared_h")):
            self.bad("source.vector_ndim", "{per_expert, shared_h} each 1 or 2", ndim)

    def _ranks(self, ranks: Any) -> None:
        tp = self.doc["tp"]
        if not isinstance(ranks, list) or not all(is_int(r) and 0 <= r < tp for r in ranks) \
                or len(set(ranks)) != len(ranks):
            self.bad("ranks", f"a list of distinct ranks in 0..{tp - 1}", ranks)

    def _layers(self, layers: Any) -> None:
        if not isinstance(layers, dict):
            self.bad("layers", "an object", layers)
            return
        for layer, entry in layers.items():
            key = f"layers[{_quoted(layer)}]"
            if not _LAYER_KEY.fullmatch(layer):
                self.bad(f"{key} key", "a layer number such as \"3\"", layer)
            elif not isinstance(entry, dict) or not isinstance(entry.get("tiers"), list) or not entry["tiers"]:
                self.bad(f"{key}.tiers", "a non-empty list of tiers", entry.get("tiers") if isinstance(entry, dict)
                         else entry)
            else:
                for t, tier in enumerate(entry["tiers"]):
                    self._tier(f"{key}.tiers[{t}]", tier)
                self._names(f"{key}.source_files", entry.get("source_files", []))

    def _tier(self, key: str, tier: Any) -> None:
        if not isinstance(tier, dict):
            self.bad(key, "an object {k, size, experts}", tier)
            return
        k_ok = self._positive_int(f"{key}.k", tier.get("k"), 8)
        size_ok = self._positive_int(f"{key}.size", tier.get("size"), MAX_TIER_EXPERTS)
        experts, num_experts = tier.get("experts"), self.doc["geometry"]["num_experts"]
        try:
            bounds = range_bounds(experts) if isinstance(experts, str) else None
        except ValueError:
            bounds = None
        if bounds is None:
            self.bad(f"{key}.experts", "ascending expert ids as ranges, e.g. \"0,2-4\"", experts)
        elif bounds and bounds[-1][1] >= num_experts:
            self.bad(f"{key}.experts", f"expert ids below geometry.num_experts {num_experts}", experts)
        elif k_ok and size_ok and sum(last - first + 1 for first, last in bounds) != tier["size"]:
            self.bad(f"{key}.experts", f"{tier['size']} ids (the tier's size)", experts)

    def _names(self, key: str, names: Any) -> None:
        if not isinstance(names, list):
            self.bad(key, "a list of file names", names)
            return
        for i, name in enumerate(names):
            self._name(f"{key}[{i}]", name, suffix=".safetensors")

    def _name(self, key: str, name: Any, suffix: str = "") -> bool:
        if isinstance(name, str) and not mf.safe_name(name):
            self.escape(key, name)
            return False
        if not isinstance(name, str) or not name.endswith(suffix):
            self.bad(key, f"a file name ending in {suffix}" if suffix else "a file name", name)
            return False
        return True

    def _files(self, files: Any) -> None:
        if not isinstance(files, dict):
            self.bad("files", "an object", files)
            return
        if CONFIG_NAME not in files:  # every pack has one; --to tr3 restores the source's from it
            self.bad(f"files[{CONFIG_NAME!r}]", "present", "absent")
        for name, entry in files.items():
            key = f"files[{_quoted(name)}]"
            if not self._name(f"{key} key", name):
                continue
            if not isinstance(entry, dict):
                self.bad(key, "an object {sha256, size, ...}", entry)
                continue
            if not isinstance(entry.get("sha256"), str):
                self.bad(f"{key}.sha256", "a hex string", entry.get("sha256"))
            if not is_int(entry.get("size")) or entry["size"] < 0:
                self.bad(f"{key}.size", "an integer >= 0", entry.get("size"))
            for field in ("layer", "rank"):
                if field in entry and (not is_int(entry[field]) or entry[field] < 0):
                    self.bad(f"{key}.{field}", "an integer >= 0", entry[field])
            layer, rank = entry.get("layer"), entry.get("rank")
            if is_int(layer) and is_int(rank) and layer >= 0 and rank >= 0 and name != layer_file_name(layer, rank):
                # The name is what readers open for (layer, rank); the entry must say the same.
                self.bad(f"{key}.layer, .rank", f"the layer and rank its name says", {"layer": layer, "rank": rank})
            role = entry.get("role")
            if role is not None and role not in FILE_ROLES:
                self.bad(f"{key}.role", f"one of {list(FILE_ROLES)}", role)
            if role == "extra":
                self._name(f"{key}.source_file", entry.get("source_file"), suffix=".safetensors")


def _quoted(key: str) -> str:
    """A manifest key as it appears in a finding's key path, cut short like `_shown`."""
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."


def _shown(value: Any) -> str:
    """A manifest value as it appears in the JSON, cut short (a hostile value may be large)."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_files(root: Path, doc: dict[str, Any], report: Report, check_hashes: bool) -> None:
    listed = doc["files"]
    pack = LocalSource(root)
    for name, entry in sorted(listed.items()):
        path = root / name
        where = Location(file=name)
        if pack.escapes(name):  # a link out of the directory: never read what it points at
            report.findings.append(error("path.escape", where, "file resolves outside the route pack",
                                         "a file inside the directory", str(path.resolve())))
            continue
        if not path.is_file():
            report.findings.append(error("repack.missing-file", where, "listed in the manifest but absent"))
            continue
        size = path.stat().st_size
        if size != entry.get("size"):
            report.findings.append(error("repack.size-mismatch", where, "size differs from the manifest",
                                         entry.get("size"), size))
            continue
        if check_hashes:
            digest = mf.sha256_file(path)
            report.count("bytes hashed", size)
            if digest != entry.get("sha256"):
                report.findings.append(error("repack.hash-mismatch", where, "sha256 differs from the manifest",
                                             entry.get("sha256"), digest))
        report.count("files")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST_NAME and rel not in listed:
            report.findings.append(warning("repack.unlisted-file", Location(file=rel), "not listed in the manifest"))


def _check_layer_file(root: Path, doc: dict, layer: int, rank: int, entry: dict, report: Report) -> None:
    name = layer_file_name(layer, rank)
    where = Location(file=name, layer=layer, rank=rank)
    if name not in doc["files"]:
        report.findings.append(error("repack.missing-file", where, "layer file not listed in the manifest"))
        return
    path = root / name
    if not path.is_file():
        return  # already reported by _check_files
    try:
        header = read_local_header(path, name)
    except HeaderError as e:
        report.findings.append(error("repack.layer-header", where, str(e)))
        return
    layout = list(check_shard(name, header))
    if layout:  # overlapping, misplaced or mis-sized byte ranges: safetensors would refuse to open the file
        report.extend(layout)
        return
    report.count("layer files")
    findings = _LayerChecks(path, doc, layer, rank, entry, header).run()
    report.extend(findings)


class _LayerChecks:
    """The consistency rules for one layer file; collects findings, never raises on bad data."""

    def __init__(self, path: Path, doc: dict, layer: int, rank: int, entry: dict, header) -> None:
        self.path, self.doc, self.layer, self.rank, self.entry, self.header = path, doc, layer, rank, entry, header
        self.geometry = doc["geometry"]
        self.findings: list = []

    def where(self, tensor: str | None = None) -> Location:
        return Location(file=self.path.name, layer=self.layer, rank=self.rank, tensor=tensor)

    def fail(self, code: str, message: str, expected: Any = None, found: Any = None, tensor: str | None = None):
        self.findings.append(error(code, self.where(tensor), message, expected, found))

    def run(self) -> list:
        self._metadata()
        tiers = self.entry["tiers"]  # shape checked by manifest_findings
        names = set(self.header.tensors)
        expected = {tier_trellis_name(t) for t in range(len(tiers))} | set(TABLE_NAMES)
        for missing in sorted(expected - names):
            self.fail("repack.missing-tensor", "tensor absent", tensor=missing)
        for extra in sorted(names - expected):
            self.fail("repack.unexpected-tensor", "tensor not in the format", tensor=extra)
        if expected - names:
            return self.findings
        self._shapes(tiers)
        if not any(f.code in ("repack.shape", "repack.dtype") for f in self.findings):
            self._tables(tiers)
        return self.findings

    def _metadata(self) -> None:
        meta = self.header.metadata
        want = {"schema": SCHEMA, "schema_version": str(SCHEMA_VERSION), "layer": str(self.layer),
                "rank": str(self.rank), "tp": str(self.doc["tp"]), "hidden": str(self.geometry["hidden"]),
                "intermediate_rank": str(self.geometry["intermediate_rank"]), "codebook": str(self.doc["codebook"]),
                "rotation": str(self.doc["rotation"]), "num_experts": str(self.geometry["num_experts"])}
        for key, value in want.items():
            if meta.get(key) != value:
                self.fail("repack.metadata", f"__metadata__ {key} disagrees with the manifest", value, meta.get(key))

    def _shapes(self, tiers: list) -> None:
        h, i_r = self.geometry["hidden"], self.geometry["intermediate_rank"]
        e_all = self.geometry["num_experts"]
        served = sum(t["size"] for t in tiers)
        rows = 1 if self.doc["rotation"] == "shared_h" else served
        want = {GLOBAL_TO_COMBINED: (e_all,), DESCRIPTORS: (served,), TIER_K: (len(tiers),),
                TIER_SIZE: (len(tiers),), ROT_INTERMEDIATE: (served, 3, i_r), ROT_GATE_SUH: (rows, h),
                ROT_UP_SUH: (rows, h), ROT_DOWN_SVH: (rows, h)}
        for t, tier in enumerate(tiers):
            want[tier_trellis_name(t)] = tier_trellis_shape(tier["size"], h, i_r, tier["k"])
        for name, shape in want.items():
            e = self.header.tensors[name]
            dtype = TABLE_DTYPES.get(name, "I16")
            if e.dtype != dtype:
                self.fail("repack.dtype", "wrong dtype", dtype, e.dtype, tensor=name)
            if tuple(e.shape) != tuple(shape):
                code = "repack.rotation" if name.startswith("rot.") else "repack.shape"
                self.fail(code, "shape disagrees with the manifest's tiers and geometry", list(shape), list(e.shape),
                          tensor=name)

    def _tables(self, tiers: list) -> None:
        import numpy as np
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            tier_k = f.get_tensor(TIER_K).tolist()
            tier_size = f.get_tensor(TIER_SIZE).tolist()
            g2c = f.get_tensor(GLOBAL_TO_COMBINED).tolist()
            desc = f.get_tensor(DESCRIPTORS).tolist()
            rot = [f.get_tensor(n) for n in (ROT_INTERMEDIATE, ROT_GATE_SUH, ROT_UP_SUH, ROT_DOWN_SVH)]
        if tier_k != [t["k"] for t in tiers]:
            self.fail("repack.tier-k", "tier_k disagrees with the manifest", [t["k"] for t in tiers], tier_k)
        if tier_k != sorted(set(tier_k)):
            self.fail("repack.tier-k", "tier K values must be distinct and ascending", found=tier_k)
        if tier_size != [t["size"] for t in tiers] or any(s > MAX_TIER_EXPERTS or s < 1 for s in tier_size):
            self.fail("repack.tier-size", f"tier sizes must match the slabs and be 1..{MAX_TIER_EXPERTS}",
                      [t["size"] for t in tiers], tier_size)
        # From the manifest's sizes (at most 256 each), never from the file's, which may hold anything.
        want_desc = [descriptor(t, local) for t, tier in enumerate(tiers) for local in range(tier["size"])]
        if desc != want_desc:
            first = next((c for c, (a, b) in enumerate(zip(desc, want_desc)) if a != b), len(want_desc))
            self.fail("repack.descriptor", f"descriptor of combined id {first} is not (tier << 8) | local id",
                      want_desc[first] if first < len(want_desc) else None,
                      desc[first] if first < len(desc) else None)
        self._route_map(g2c, tiers, len(want_desc))
        for table in rot:
            if not np.isfinite(table.numpy()).all():  # numpy: torch's small CPU ops cost ~20 ms each here
                self.fail("repack.rotation", "rotation table holds NaN or infinity", tensor=ROT_INTERMEDIATE)
                break

    def _route_map(self, g2c: list[int], tiers: list, served: int) -> None:
        combined = [c for c in g2c if c != -1]
        if sorted(combined) != list(range(served)) or any(c < -1 for c in g2c):
            self.fail("repack.route-map", "global_to_combined is not a bijection from served ids onto 0..E_c-1",
                      found=f"{len(combined)} mapped ids for {served} combined slots", tensor=GLOBAL_TO_COMBINED)
            return
        start = 0
        for t, tier in enumerate(tiers):
            ids = expand_ranges(tier["experts"])  # bounded: manifest_findings checked it holds `size` ids
            got = [g for g, c in enumerate(g2c) if start <= c < start + len(ids)]
            order = sorted(got, key=lambda g: g2c[g])
            if order != ids:
                self.fail("repack.tier-experts", f"tier {t}: the experts global_to_combined places there are not "
                          f"the manifest's, in ascending order", tier.get("experts"), order[:8])
            start += len(ids)


def describe_repacked(source: Any) -> dict[str, Any]:
    """What `trellis inspect` shows for a route pack: source, geometry, TP, per-layer tiers, files, bytes."""
    root = repacked_root(source)
    doc, problems = mf.read_manifest(root)
    if doc.get("schema") != SCHEMA:
        raise CheckFailed(f"{root}: {MANIFEST_NAME} schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    structure = manifest_findings(doc)
    if structure:
        more = f" (and {len(structure) - 1} more; run `trellis validate {root}`)" if len(structure) > 1 else ""
        raise CheckFailed(f"{root}: {structure[0].line()}{more}")
    files = doc["files"]
    layer_bytes = sum(e["size"] for e in files.values() if "layer" in e)
    layers = []
    for layer, entry in sorted(doc["layers"].items(), key=lambda kv: int(kv[0])):
        tiers = entry["tiers"]
        total = sum(t["size"] for t in tiers)
        layers.append({"layer": int(layer), "tiers": tiers,
                       "bpw": round(sum(t["k"] * t["size"] for t in tiers) / total, 3)})
    source_info = {k: v for k, v in doc["source"].items() if k != "files"}
    return {
        "format": SCHEMA, "schema_version": doc["schema_version"], "path": str(root), "source": source_info,
        "geometry": doc["geometry"], "tp": doc["tp"], "ranks": doc["ranks"],
        "codebook": doc["codebook"], "rotation": doc["rotation"], "layers": layers,
        "files": len(files), "layer_file_bytes": layer_bytes,
        "total_bytes": sum(e["size"] for e in files.values()),
        "manifest_problems": problems,
    }
