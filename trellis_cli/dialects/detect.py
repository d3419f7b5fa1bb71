"""Dialect detection helpers: which on-disk contract a checkpoint follows, decided from its JSON files only.

Each dialect's `detect` calls its reader here; registry.detect asks them in this order (fail closed, never
guessed):
1. `manifest.json` with schema "trellis-route-pack" -> the repacked layout;
2. a JSON manifest with kind "exl3-manifest" and schema "exl3-v1" -> the exl3-v1 container (exl3v1/);
3. `config.json["hybrid_tr3_tail"]` with format "exl3-trellis" -> TR3 rank-sliced (per_expert_v1 / shared_h_v1);
4. `r7_routed_experts` in the embedded or external quantization config -> R7 per-projection maps;
5. quant_method "exl3" in the embedded or external quantization config -> plain exllamav3;
anything else raises UnknownDialect naming what was found.
"""

from __future__ import annotations

from typing import Any, Callable

from trellis_cli.checkpoint.model import (
    DIALECT_EXL3,
    DIALECT_EXL3V1,
    DIALECT_R7,
    DIALECT_REPACKED,
    DIALECT_TR3_PER_EXPERT,
    DIALECT_TR3_SHARED_H,
)
from trellis_cli.dialects.interface import DialectInfo, Probe
from trellis_cli.errors import UnknownDialect
from trellis_cli.formats.route_pack import MANIFEST_NAME as ROUTE_PACK_MANIFEST

TR3_FORMAT = "exl3-trellis"
ROTATION_LAYOUTS = {"per_expert_v1": DIALECT_TR3_PER_EXPERT, "shared_h_v1": DIALECT_TR3_SHARED_H}
CONFIG = "config.json"
QUANT_CONFIG = "quantization_config.json"
EXL3V1_MANIFEST = "exl3-manifest.json"  # the only name b12x's reader opens; config.json may name another
EXL3V1_KIND, EXL3V1_SCHEMA = "exl3-manifest", "exl3-v1"


def route_pack_info(files: dict[str, int], read_json: Callable[[str], Any]) -> DialectInfo | None:
    """The route-pack dialect when `manifest.json` says so, else None; needs no config.json.

    Decided before config.json is read: a pack's config.json is one of its hashed files, so a damaged one is
    the route-pack verifier's finding, not a reason to stop.
    """
    if ROUTE_PACK_MANIFEST not in files:
        return None
    manifest = read_json(ROUTE_PACK_MANIFEST)
    if isinstance(manifest, dict) and manifest.get("schema") == DIALECT_REPACKED:
        return DialectInfo(DIALECT_REPACKED, "n/a", _positive_int(manifest.get("tp")) or 1,
                           manifest.get("codebook"), {"manifest": manifest})
    return None


def exl3v1_info(probe: Probe) -> DialectInfo | None:
    return _exl3v1(probe.files, probe.config, probe.read_json)


def tr3_info(probe: Probe) -> DialectInfo | None:
    """TR3 when config.json has hybrid_tr3_tail (either rotation layout); UnknownDialect when it cannot be read."""
    if probe.config is None or probe.config.get("hybrid_tr3_tail") is None:
        return None
    return _tr3(probe.config["hybrid_tr3_tail"], _embedded(probe.config))


def r7_info(probe: Probe) -> DialectInfo | None:
    if probe.config is None:
        return None
    embedded = _embedded(probe.config)
    r7 = _first_dict(embedded, probe.quant_config, key="r7_routed_experts")
    if r7 is None:
        return None
    return DialectInfo(DIALECT_R7, "r7_shared", 1, _codebook(embedded, probe.quant_config), {"r7_routed_experts": r7})


def exl3_info(probe: Probe) -> DialectInfo | None:
    if probe.config is None:
        return None
    embedded = _embedded(probe.config)
    if "exl3" not in _methods(embedded, probe.quant_config):
        return None
    return DialectInfo(DIALECT_EXL3, "n/a", 1, _codebook(embedded, probe.quant_config), {})


def not_understood(probe: Probe) -> UnknownDialect:
    """The refusal when no dialect claims the checkpoint, naming what was found."""
    if probe.config is None:
        return UnknownDialect(_nothing_found(probe.files, "no config.json"))
    methods = _methods(_embedded(probe.config), probe.quant_config)
    found = f"quant_method {methods[0]!r}" if methods else "no quantization_config"
    return UnknownDialect(_nothing_found(probe.files, f"config.json has {found} and no hybrid_tr3_tail"))


def _embedded(config: dict) -> dict | None:
    embedded = config.get("quantization_config")
    return embedded if isinstance(embedded, dict) else None


def _methods(embedded: dict | None, quant_config: dict | None) -> list:
    return [q.get("quant_method") for q in (embedded, quant_config) if q is not None]


def _exl3v1(files: dict[str, int], config: dict | None, read_json: Callable[[str], Any]) -> DialectInfo | None:
    """exl3-v1, decided by the manifest's own identity strings (the layer files' names decide nothing).

    The manifest is the one b12x's reader opens, `exl3-manifest.json`, whatever config.json's
    `quantization_config.exl3.manifest` names: a directory whose exl3-v1 manifest exists only under that other
    name is still exl3-v1 (so it is refused by name, not called unknown), with no manifest to load.
    """
    named = _config_manifest_name(config)
    if EXL3V1_MANIFEST not in files:
        if named is None or named not in files or not _is_exl3v1(read_json(named)):
            return None
        return DialectInfo(DIALECT_EXL3V1, "n/a", 1, None, {"exl3v1_manifest": None,
                                                            "exl3v1_manifest_file": EXL3V1_MANIFEST,
                                                            "exl3v1_config_manifest": named})
    doc = read_json(EXL3V1_MANIFEST)
    if not isinstance(doc, dict) or (doc.get("kind") != EXL3V1_KIND and doc.get("schema") != EXL3V1_SCHEMA):
        return None
    if not _is_exl3v1(doc):
        raise UnknownDialect(f"{EXL3V1_MANIFEST}: kind {doc.get('kind')!r}, schema {doc.get('schema')!r}; trellis "
                             f"reads kind {EXL3V1_KIND!r} with schema {EXL3V1_SCHEMA!r}")
    codebook = doc.get("codebook")
    return DialectInfo(DIALECT_EXL3V1, "n/a", 1, codebook if isinstance(codebook, str) else None,
                       {"exl3v1_manifest": doc, "exl3v1_manifest_file": EXL3V1_MANIFEST,
                        "exl3v1_config_manifest": named})


def _is_exl3v1(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == EXL3V1_KIND and doc.get("schema") == EXL3V1_SCHEMA


def _config_manifest_name(config: dict | None) -> str | None:
    """config.json's `quantization_config.exl3.manifest` when it names a file inside the directory other than
    the reader's own name; else None."""
    quant = (config or {}).get("quantization_config")
    exl3 = quant.get("exl3") if isinstance(quant, dict) else None
    name = exl3.get("manifest") if isinstance(exl3, dict) else None
    from trellis_cli.header import safe_relative

    return name if isinstance(name, str) and name != EXL3V1_MANIFEST and safe_relative(name) else None


def _tr3(hybrid: Any, embedded: dict | None) -> DialectInfo:
    if not isinstance(hybrid, dict):
        raise UnknownDialect(f"config.json: hybrid_tr3_tail is a JSON {type(hybrid).__name__}, expected an object")
    if not isinstance(hybrid.get("format"), str) or hybrid.get("format") != TR3_FORMAT:
        raise UnknownDialect(
            f"config.json: hybrid_tr3_tail.format is {hybrid.get('format')!r}, expected {TR3_FORMAT!r}")
    layout = hybrid.get("rotation_layout", "per_expert_v1")
    if not isinstance(layout, str) or layout not in ROTATION_LAYOUTS:
        raise UnknownDialect(f"config.json: hybrid_tr3_tail.rotation_layout is {layout!r}, "
                             f"expected one of {', '.join(ROTATION_LAYOUTS)}")
    codebook = hybrid.get("codebook")
    if codebook is None and embedded is not None:
        codebook = embedded.get("codebook")
    return DialectInfo(ROTATION_LAYOUTS[layout], layout, _positive_int(hybrid.get("tp")) or 1,
                       codebook if isinstance(codebook, str) else None, {"hybrid_tr3_tail": hybrid})


def _first_dict(*configs: dict | None, key: str) -> dict | None:
    for q in configs:
        if q is not None and isinstance(q.get(key), dict):
            return q[key]
    return None


def _codebook(*configs: dict | None) -> str | None:
    for q in configs:
        if q is not None and isinstance(q.get("codebook"), str):
            return q["codebook"]
    return None


def _positive_int(value: Any) -> int | None:
    """A positive count as the loaders that coerce with int() read it (the shared-H version's refusal of a
    string is its own engine rule)."""
    from trellis_cli.header import coerced_int

    n = coerced_int(value)
    return n if n is not None and n > 0 else None


def _nothing_found(files: dict[str, int], what: str) -> str:
    shown = ", ".join(list(files)[:6]) + (", ..." if len(files) > 6 else "")
    return (f"not a checkpoint dialect trellis understands: {what} "
            f"(found {len(files)} file(s): {shown or 'none'}); expected a TR3 hybrid_tr3_tail contract, "
            "an exl3 quantization_config, R7 metadata, an exl3-v1 manifest or a route-pack manifest.json")
