"""Validate and describe a route-pack directory: `verify_route_pack`, `describe_route_pack`.

Needs no source checkpoint: the manifest states every file's sha256 and size, and each layer file must be
self-consistent (tier K ascending and matching the slab shapes, tier sizes <= 256, descriptors equal to
(tier << 8) | local id in combined order, global_to_combined a bijection onto the combined ids, rotation
tables shaped for the geometry). Every problem is a finding with a stable `repack.*` code.

The manifest is untrusted input: its structure, types and file names are checked first (`manifest_findings`,
manifest_shape.py), and nothing after that reads a key or opens a name it has not vouched for. The
work done is bounded by what the directory holds, not by what the manifest declares: a count of listed files
or of (layer, rank) pairs above that is one `count.implausible`, and missing items are listed up to a cap
while they are found, then counted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterator, TypedDict

from trellis_cli.checkpoint.model import MIN_COUNT_LIMIT, Checkpoint
from trellis_cli.errors import CheckFailed, SourceUnavailable
from trellis_cli.findings import MAX_MISSING_SHOWN, Finding, Location, Report, error, error_summary, missing_ids, summary_finding, warning
from trellis_cli.header import HeaderError, read_local_header
from trellis_cli.id_ranges import expand_ranges
from trellis_cli.integrity import RecordedHash, check_recorded
from trellis_cli.dialects.routepack import manifest as mf
from trellis_cli.formats.layer_pack import DESCRIPTORS, GLOBAL_TO_COMBINED, MAX_TIER_EXPERTS, ROT_DOWN_SVH, ROT_GATE_SUH, ROT_INTERMEDIATE, ROT_UP_SUH, TABLE_NAMES, TIER_K, TIER_SIZE, descriptor, tier_trellis_name, tier_trellis_shape
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME, SCHEMA, SCHEMA_VERSION, layer_file_name
from trellis_cli.dialects.routepack.manifest_shape import CONFIG_NAME, manifest_findings
from trellis_cli.sources import LocalSource, SourceArg, read_json_file
from trellis_cli.formats.safetensors_layout import check_shard

# layer_file_name's form; bounded like manifest layer keys (ranks only by tp), so int() stays cheap
_LAYER_FILE = re.compile(r"layer-([0-9]{1,9})-rank-([0-9]{1,40})\.safetensors")
TABLE_DTYPES = {GLOBAL_TO_COMBINED: "I32", DESCRIPTORS: "I32", TIER_K: "I32", TIER_SIZE: "I32",
                ROT_INTERMEDIATE: "F16", ROT_GATE_SUH: "F16", ROT_UP_SUH: "F16", ROT_DOWN_SVH: "F16"}


def route_pack_root(source: SourceArg | Checkpoint) -> Path:
    """A directory from a path, a local Source, or a Checkpoint opened on one."""
    if isinstance(source, (str, Path)):
        return Path(source)
    if isinstance(source, Checkpoint):
        source = source.source
    if source.root is None:
        raise CheckFailed(f"{source.description}: a route pack is read from a local directory only")
    return source.root


def require_route_pack(root: Path, what: str, *, check_hashes: bool) -> None:
    """`verify_route_pack`, its first error raised as CheckFailed ("ROOT: WHAT does not verify: ...")."""
    report = verify_route_pack(root, check_hashes=check_hashes)
    if not report.ok:
        raise CheckFailed(f"{root}: {what} does not verify: {report.errors[0].line()}")


def verify_route_pack(source: SourceArg | Checkpoint, *, check_hashes: bool = True,
                    progress: Callable[[int], None] | None = None) -> Report:
    """Check schema, file hashes and sizes against the manifest, and every layer file's consistency.
    `progress(n)` is called with the bytes hashed as they are read."""
    root = route_pack_root(source)
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
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    # Each listed file, and each declared (layer, rank), needs a file of its own: a count above what the
    # directory holds is one `count.implausible`, never one finding (or one object) per missing item.
    limit = max(len(on_disk), MIN_COUNT_LIMIT)
    pack = LocalSource(root)
    _check_files(pack, doc, report, check_hashes, on_disk, limit, progress)
    _check_config(pack, report)
    _check_layer_files(pack, doc, report, limit, len(on_disk))
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


def _implausible(key: str, what: str, count: int, limit: int, present: int) -> Finding:
    return error("count.implausible", Location(file=MANIFEST_NAME, tensor=key), f"{what}: far more than the "
                 "directory holds (reported once, not per missing file)",
                 expected=f"<= {limit} ({present} files present)", found=count)


def _check_files(pack: LocalSource, doc: dict[str, Any], report: Report, check_hashes: bool, on_disk: set[str],
                 limit: int, progress: Callable[[int], None] | None = None) -> None:
    listed = doc["files"]
    names = sorted(listed)
    if len(listed) > limit:  # only what is there is checked; the rest is this one finding
        report.findings.append(_implausible("files", f"{len(listed)} files listed", len(listed), limit,
                                            len(on_disk)))
        names = [n for n in names if n in on_disk]
    absent = [n for n in names if not _check_listed_file(pack, n, listed[n], report, check_hashes, progress)]
    report.extend(_capped(absent, lambda n: error("repack.missing-file", Location(file=n), "listed in the "
                                                  "manifest but absent"), "files listed in the manifest but absent"))
    unlisted = sorted(rel for rel in on_disk if rel != MANIFEST_NAME and rel not in listed)
    report.extend(_capped(unlisted, lambda n: warning("repack.unlisted-file", Location(file=n), "not listed in "
                                                      "the manifest"), "files not listed in the manifest"))


def _capped(items: list, make_one, what: str, where: Location = Location(file=MANIFEST_NAME)) -> Iterator[Finding]:
    """The first MAX_MISSING_SHOWN items as findings, then one finding of the same code with how many more."""
    for item in items[:MAX_MISSING_SHOWN]:
        last = make_one(item)
        yield last
    if len(items) > MAX_MISSING_SHOWN:
        yield summary_finding(last.code, last.severity, where, len(items) - MAX_MISSING_SHOWN,
                              f"{what} ({len(items)} in all)")


def _check_listed_file(pack: LocalSource, name: str, entry: dict, report: Report, check_hashes: bool,
                       progress: Callable[[int], None] | None = None) -> bool:
    """Size and hash of one listed file; False when it is absent (the caller reports those, capped)."""
    path = pack.root / name
    where = Location(file=name)
    if pack.escapes(name):  # a link out of the directory: never read what it points at
        report.findings.append(error("path.escape", where, "file resolves outside the route pack",
                                     "a file inside the directory", str(path.resolve())))
        return True
    if not path.is_file():
        return False
    size = path.stat().st_size
    if size != entry.get("size"):
        report.findings.append(error("repack.size-mismatch", where, "size differs from the manifest",
                                     entry.get("size"), size))
        return True
    if check_hashes:  # the one comparison of recorded hashes (integrity.check_recorded)
        sha256: Any = entry.get("sha256")  # checked as a digest by the manifest's shape rules
        recorded = RecordedHash(name, sha256, where, "repack.hash-mismatch",
                                "sha256 differs from the manifest", size)
        check_recorded(pack, [recorded], report, progress)
    report.count("files")
    return True


def _check_config(pack: LocalSource, report: Report) -> None:
    """config.json must be a JSON object: the loader and `repack --to tr3` read it, and a hash matching the
    manifest only says it is what the writer listed. Absent, or outside the pack: already reported."""
    path = pack.root / CONFIG_NAME
    if pack.escapes(CONFIG_NAME) or not path.is_file():
        return
    try:
        config = read_json_file(path, CONFIG_NAME)
    except (CheckFailed, SourceUnavailable) as e:
        report.findings.append(error("repack.config", Location(file=CONFIG_NAME), str(e).split(": ", 1)[-1]))
        return
    if not isinstance(config, dict):
        report.findings.append(error("repack.config", Location(file=CONFIG_NAME), "not a JSON object",
                                     "object", type(config).__name__))


def _check_layer_files(pack: LocalSource, doc: dict, report: Report, limit: int, present: int) -> None:
    """Every declared (layer, rank) needs a listed layer file; each listed one is checked.

    Costs O(files listed + MAX_MISSING_SHOWN), never O(layers x ranks): the declared pairs are numbered
    (layer position * ranks + rank position) and only the listed ones are looked at.
    """
    layers, ranks = sorted(int(k) for k in doc["layers"]), doc["ranks"]
    declared = len(layers) * len(ranks)
    listed = _listed_pairs(doc["files"], layers, ranks)
    if declared > limit:
        report.findings.append(_implausible("layers, ranks", f"{len(layers)} layers x {len(ranks)} ranks declare "
                                            f"{declared} layer files", declared, limit, present))
    else:
        first, total = missing_ids(range(declared), listed)
        for pair in first:
            layer, rank = layers[pair // len(ranks)], ranks[pair % len(ranks)]
            report.findings.append(error("repack.missing-file", Location(file=layer_file_name(layer, rank),
                                         layer=layer, rank=rank), "layer file not listed in the manifest"))
        if total > len(first):
            report.findings.append(error_summary("repack.missing-file", Location(file=MANIFEST_NAME),
                                                 total - len(first), "layer files not listed in the manifest",
                                                 f"{declared} ({len(layers)} layers x {len(ranks)} ranks)",
                                                 f"{total} not listed"))
    for pair in sorted(listed):
        layer, rank = layers[pair // len(ranks)], ranks[pair % len(ranks)]
        _check_layer_file(pack, doc, layer, rank, doc["layers"][str(layer)], report)


def _listed_pairs(files: dict, layers: list[int], ranks: list[int]) -> set[int]:
    """The declared (layer, rank) pairs whose layer file the manifest lists, numbered as in _check_layer_files."""
    layer_at = {layer: i for i, layer in enumerate(layers)}
    rank_at = {rank: i for i, rank in enumerate(ranks)}
    pairs = set()
    for name in files:
        match = _LAYER_FILE.fullmatch(name)
        if match is None:
            continue
        layer, rank = int(match[1]), int(match[2])
        if layer in layer_at and rank in rank_at and name == layer_file_name(layer, rank):
            pairs.add(layer_at[layer] * len(ranks) + rank_at[rank])
    return pairs


def _check_layer_file(pack: LocalSource, doc: dict, layer: int, rank: int, entry: dict, report: Report) -> None:
    name = layer_file_name(layer, rank)
    where = Location(file=name, layer=layer, rank=rank)
    path = pack.root / name
    if pack.escapes(name) or not path.is_file():
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
        for missing in sorted(expected - names):  # at most 8 tiers and the tables
            self.fail("repack.missing-tensor", "tensor absent", tensor=missing)
        self.findings.extend(_capped(sorted(names - expected), lambda extra: error(  # as many as the header holds
            "repack.unexpected-tensor", self.where(extra), "tensor not in the format"), "tensors not in the format",
            self.where()))
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
        by_combined = [g for _, g in sorted((c, g) for g, c in enumerate(g2c) if c != -1)]  # one pass, not per tier
        start = 0
        for t, tier in enumerate(tiers):
            ids = expand_ranges(tier["experts"])  # bounded: manifest_findings checked it holds `size` ids
            order = by_combined[start:start + len(ids)]
            if order != ids:
                self.fail("repack.tier-experts", f"tier {t}: the experts global_to_combined places there are not "
                          f"the manifest's, in ascending order", tier.get("experts"), order[:8])
            start += len(ids)


class ManifestLayer(TypedDict):
    """One layer as the manifest records it, with its mean bits per weight."""

    layer: int
    tiers: list[dict[str, Any]]  # the manifest's tiers: k, size, experts (id ranges)
    bpw: float


class RoutePackDescription(TypedDict):
    """What a route pack's manifest says of it, in the manifest's own names (inspect renames them)."""

    format: str
    schema_version: int
    path: str
    source: dict[str, Any]  # the checkpoint it was made from, its file list left out
    geometry: dict[str, Any]
    tp: int
    ranks: Any  # as the manifest records them
    codebook: str
    rotation: str
    layers: list[ManifestLayer]
    files: int
    layer_file_bytes: int
    total_bytes: int
    manifest_problems: list[str]


def describe_route_pack(source: SourceArg | Checkpoint) -> RoutePackDescription:
    """What `trellis inspect` shows for a route pack: source, geometry, TP, per-layer tiers, files, bytes."""
    root = route_pack_root(source)
    doc, problems = mf.read_manifest(root)
    if doc.get("schema") != SCHEMA:
        raise CheckFailed(f"{root}: {MANIFEST_NAME} schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    structure = manifest_findings(doc)
    if structure:
        more = f" (and more; run `trellis validate {root}`)" if len(structure) > 1 else ""  # the list is capped
        raise CheckFailed(f"{root}: {structure[0].line()}{more}")
    files = doc["files"]
    layer_bytes = sum(e["size"] for e in files.values() if "layer" in e)
    layers: list[ManifestLayer] = []
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
        # manifest.json counted too, as validate counts it: the files of the directory, not of the listing
        "files": len(files) + 1, "layer_file_bytes": layer_bytes,
        "total_bytes": sum(e["size"] for e in files.values()) + _size(root / MANIFEST_NAME),
        "manifest_problems": problems,
    }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
