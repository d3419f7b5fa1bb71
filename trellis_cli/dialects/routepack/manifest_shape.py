"""The structure of a route-pack manifest: every key the readers use, with the type and range they rely on.

`manifest_findings(doc)` runs before anything else reads the manifest, so the rest of the code can index it
freely, and every name it joins onto a directory stays inside it. The manifest is untrusted input: findings
are capped while they are made (a 64 MB manifest of bad entries costs a counter, not a list), and tiers are
bounded (distinct ascending K of 1..8, at most 256 experts each) so no later loop grows with the manifest.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from trellis_cli.findings import MAX_FINDINGS_PER_CODE, Location, error, error_summary
from trellis_cli.header import is_int
from trellis_cli.id_ranges import range_bounds
from trellis_cli.dialects.routepack import manifest as mf
from trellis_cli.formats.layer_pack import CODEBOOK_IDS, MAX_TIER_EXPERTS, ROTATIONS
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME, layer_file_name

REQUIRED_KEYS = ("schema", "schema_version", "source", "geometry", "tp", "ranks", "codebook", "rotation", "layers",
                 "files")
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,8}")  # as str(layer) writes it; bounded, so int() stays cheap
FILE_ROLES = ("config", "copied", "extra")
CONFIG_NAME = "config.json"
MAX_K = 8  # codec.MAX_K, without importing torch to read a manifest


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
        self.made: Counter[str] = Counter()  # per code, kept or not

    def add(self, code: str, message: str, expected: str, found: Any) -> None:
        self.made[code] += 1
        if self.made[code] <= MAX_FINDINGS_PER_CODE:  # past the cap: counted, never built
            self.findings.append(error(code, Location(file=MANIFEST_NAME), message, expected, _shown(found)))

    def bad(self, key: str, expected: str, found: Any) -> None:
        self.add("repack.manifest-field", f"{key}: wrong type or value", expected, found)

    def escape(self, key: str, name: Any) -> None:
        self.add("path.escape", f"{key}: names a path outside the route pack", "a relative path inside the directory",
                 name)

    def summaries(self) -> list:
        return [error_summary(code, Location(file=MANIFEST_NAME), n - MAX_FINDINGS_PER_CODE,
                              f"{code} finding(s) in the manifest") for code, n in self.made.items()
                if n > MAX_FINDINGS_PER_CODE]

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
        return self.findings + self.summaries()

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
            elif self._tiers(f"{key}.tiers", entry["tiers"]):
                self._names(f"{key}.source_files", entry.get("source_files", []))
                if "tr3_shard" in entry:  # the shard `--to tr3` writes the layer into (packs made from exl3-v1)
                    self._name(f"{key}.tr3_shard", entry["tr3_shard"], suffix=".safetensors")

    def _tiers(self, key: str, tiers: list) -> bool:
        """At most MAX_K tiers, each checked; their K distinct and ascending, as the layer file's tier_k."""
        if len(tiers) > MAX_K:  # K is 1..MAX_K and distinct: more tiers cannot be valid, so none is read
            self.bad(key, f"at most {MAX_K} tiers (one per K)", f"{len(tiers)} tiers")
            return False
        before = sum(self.made.values())
        for t, tier in enumerate(tiers):
            self._tier(f"{key}[{t}]", tier)
        if sum(self.made.values()) == before:
            ks = [tier["k"] for tier in tiers]
            if ks != sorted(set(ks)):
                self.bad(f"{key}[*].k", "distinct K values in ascending order", ks)
        return True

    def _tier(self, key: str, tier: Any) -> None:
        if not isinstance(tier, dict):
            self.bad(key, "an object {k, size, experts}", tier)
            return
        k_ok = self._positive_int(f"{key}.k", tier.get("k"), MAX_K)
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
                self.bad(f"{key}.layer, .rank", "the layer and rank its name says", {"layer": layer, "rank": rank})
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


