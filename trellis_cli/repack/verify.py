"""Validate and describe a repacked (route-pack) directory: `verify_repacked`, `describe_repacked`.

Needs no source checkpoint: the manifest states every file's sha256 and size, and each layer file must be
self-consistent (tier K ascending and matching the slab shapes, tier sizes <= 256, descriptors equal to
(tier << 8) | local id in combined order, global_to_combined a bijection onto the combined ids, rotation
tables shaped for the geometry). Every problem is a finding with a stable `repack.*` code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trellis_cli.errors import CheckFailed
from trellis_cli.findings import Location, Report, error, warning
from trellis_cli.header import DTYPE_BYTES, HeaderError, read_local_header
from trellis_cli.id_ranges import expand_ranges
from trellis_cli.repack import manifest as mf
from trellis_cli.repack.format import (
    DESCRIPTORS, GLOBAL_TO_COMBINED, MANIFEST_NAME, MAX_TIER_EXPERTS, ROT_DOWN_SVH, ROT_GATE_SUH, ROT_INTERMEDIATE,
    ROT_UP_SUH, SCHEMA, SCHEMA_VERSION, TABLE_NAMES, TIER_K, TIER_SIZE, descriptor, layer_file_name,
    tier_trellis_name, tier_trellis_shape,
)

REQUIRED_KEYS = ("schema", "schema_version", "source", "geometry", "tp", "ranks", "codebook", "rotation", "layers",
                 "files")
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
                           "source": _source_label(doc.get("source", {}))})
    _check_files(root, doc, report, check_hashes)
    for layer, entry in sorted(doc["layers"].items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1):
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
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        report.findings.append(error("repack.manifest-field", where, f"missing key {missing[0]!r}"))
        return False
    geometry = doc["geometry"]
    if not isinstance(geometry, dict) or not all(isinstance(geometry.get(k), int)
                                                 for k in ("hidden", "intermediate_rank", "num_experts")):
        report.findings.append(error("repack.manifest-field", where, "geometry needs integer hidden, "
                                                                     "intermediate_rank, num_experts"))
        return False
    if not isinstance(doc["layers"], dict) or not isinstance(doc["files"], dict) or not isinstance(doc["ranks"], list):
        report.findings.append(error("repack.manifest-field", where, "layers/files must be objects, ranks a list"))
        return False
    return True


def _check_files(root: Path, doc: dict[str, Any], report: Report, check_hashes: bool) -> None:
    listed = doc["files"]
    for name, entry in sorted(listed.items()):
        path = root / name
        where = Location(file=name)
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
        tiers = self.entry.get("tiers") if isinstance(self.entry, dict) else None
        if not isinstance(tiers, list):
            self.fail("repack.manifest-field", f"layer {self.layer}: no tiers list in the manifest")
            return self.findings
        names = set(self.header.tensors)
        expected = {tier_trellis_name(t) for t in range(len(tiers))} | set(TABLE_NAMES)
        for missing in sorted(expected - names):
            self.fail("repack.missing-tensor", "tensor absent", tensor=missing)
        for extra in sorted(names - expected):
            self.fail("repack.unexpected-tensor", "tensor not in the format", tensor=extra)
        if expected - names:
            return self.findings
        self._entries()
        self._shapes(tiers)
        if not any(f.code in ("repack.shape", "repack.dtype", "repack.entry") for f in self.findings):
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

    def _entries(self) -> None:
        """Each tensor's byte range must match its dtype and shape (the header parser leaves that to us)."""
        for name, e in self.header.tensors.items():
            if e.nbytes != math.prod(e.shape) * DTYPE_BYTES.get(e.dtype, 0):
                self.fail("repack.entry", "byte range does not match dtype and shape", tensor=name)

    def _shapes(self, tiers: list) -> None:
        h, i_r = self.geometry["hidden"], self.geometry["intermediate_rank"]
        e_all = self.geometry["num_experts"]
        served = sum(int(t.get("size", 0)) for t in tiers)
        rows = 1 if self.doc["rotation"] == "shared_h" else served
        want = {GLOBAL_TO_COMBINED: (e_all,), DESCRIPTORS: (served,), TIER_K: (len(tiers),),
                TIER_SIZE: (len(tiers),), ROT_INTERMEDIATE: (served, 3, i_r), ROT_GATE_SUH: (rows, h),
                ROT_UP_SUH: (rows, h), ROT_DOWN_SVH: (rows, h)}
        for t, tier in enumerate(tiers):
            k = tier.get("k")
            if not isinstance(k, int) or not 1 <= k <= 8:
                self.fail("repack.tier-k", f"tier {t}: K must be 1..8", found=k)
                continue
            want[tier_trellis_name(t)] = tier_trellis_shape(int(tier.get("size", 0)), h, i_r, k)
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
        want_desc = [descriptor(t, local) for t, size in enumerate(tier_size) for local in range(size)]
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
            try:
                ids = expand_ranges(str(tier.get("experts", "")))
            except ValueError:
                self.fail("repack.manifest-field", f"tier {t}: experts is not a list of id ranges")
                continue
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
    files = doc.get("files", {})
    layer_bytes = sum(e.get("size", 0) for n, e in files.items() if "layer" in e)
    layers = []
    for layer, entry in sorted(doc.get("layers", {}).items(), key=lambda kv: int(kv[0])):
        tiers = entry.get("tiers", [])
        total = sum(t["size"] for t in tiers) or 1
        layers.append({"layer": int(layer), "tiers": tiers,
                       "bpw": round(sum(t["k"] * t["size"] for t in tiers) / total, 3)})
    source_info = {k: v for k, v in doc.get("source", {}).items() if k != "files"}
    return {
        "format": SCHEMA, "schema_version": doc.get("schema_version"), "path": str(root), "source": source_info,
        "geometry": doc.get("geometry"), "tp": doc.get("tp"), "ranks": doc.get("ranks"),
        "codebook": doc.get("codebook"), "rotation": doc.get("rotation"), "layers": layers,
        "files": len(files), "layer_file_bytes": layer_bytes,
        "total_bytes": sum(e.get("size", 0) for e in files.values()),
        "manifest_problems": problems,
    }
