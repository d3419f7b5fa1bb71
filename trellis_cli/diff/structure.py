"""The declarations of two checkpoints, key by key: model facts, config.json, quantization metadata, manifests.

Nested objects are compared leaf by leaf under dotted keys (`hybrid_tr3_tail.tp`); lists are compared whole.
Only JSON the model already read (or a route pack's and an exl3-v1's own small JSON files) is used.
"""

from __future__ import annotations

from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.registry import ROUTE_PACK, SLOT_ROWS, storage_of
from trellis_cli.diff.result import StructureChange
from trellis_cli.errors import CheckFailed

FACTS = ("dialect", "tp", "codebook", "rotation_layout", "hidden", "intermediate", "num_experts")
CONFIG = "config.json"
QUANT_CONFIG = "quantization_config.json"
ROUTE_PACK_ROTATIONS = {"per_expert": "per_expert_v1", "shared_h": "shared_h_v1"}
MISSING = None  # a key absent on one side is shown as null


def structure_changes(a: Checkpoint, b: Checkpoint) -> list[StructureChange]:
    fa, fb = model_facts(a), model_facts(b)
    changes = [StructureChange("checkpoint", name, fa[name], fb[name]) for name in FACTS if fa[name] != fb[name]]
    docs_a, docs_b = _documents(a), _documents(b)
    for what in sorted(docs_a.keys() | docs_b.keys()):
        changes += _keyed(what, docs_a.get(what), docs_b.get(what))
    return changes


def model_facts(ck: Checkpoint) -> dict[str, Any]:
    """The model's facts; a route pack's geometry and rotation layout come from its manifest (the model leaves
    them to the route-pack verifier)."""
    facts = {name: getattr(ck, name) for name in FACTS}
    manifest = ck.declared.get("manifest") if storage_of(ck) == ROUTE_PACK else None
    if isinstance(manifest, dict):
        geometry = manifest.get("geometry") if isinstance(manifest.get("geometry"), dict) else {}
        facts.update(hidden=geometry.get("hidden"), intermediate=geometry.get("intermediate"),
                     num_experts=geometry.get("num_experts"),
                     rotation_layout=ROUTE_PACK_ROTATIONS.get(manifest.get("rotation"), ck.rotation_layout))
    if storage_of(ck) == SLOT_ROWS:
        facts["tp"] = None  # a rank is a slot extent: no stored TP
    return facts


def _documents(ck: Checkpoint) -> dict[str, Any]:
    docs: dict[str, Any] = {}
    config = ck.config or (_read(ck, CONFIG) if storage_of(ck) == ROUTE_PACK else None)
    if config:
        docs[CONFIG] = config
    if ck.quant_config:
        docs[QUANT_CONFIG] = ck.quant_config
    if storage_of(ck) == ROUTE_PACK and isinstance(ck.declared.get("manifest"), dict):
        docs["manifest.json"] = ck.declared["manifest"]
    if storage_of(ck) == SLOT_ROWS:
        name = ck.declared.get("exl3v1_manifest_file")
        manifest = _read(ck, name) if isinstance(name, str) else None
        if manifest is not None:
            docs[name] = manifest
    return docs


def _read(ck: Checkpoint, name: str) -> Any:
    if name not in ck.files:
        return None
    try:
        return ck.source.read_json(name)
    except CheckFailed:
        return None  # an unreadable file is validate's finding; the diff shows it as absent


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(doc, dict):
        return {prefix or "(document)": doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def _keyed(what: str, a: Any, b: Any) -> list[StructureChange]:
    fa = flatten(a) if a is not None else {}
    fb = flatten(b) if b is not None else {}
    return [StructureChange(what, key, fa.get(key, MISSING), fb.get(key, MISSING))
            for key in sorted(fa.keys() | fb.keys()) if key not in fa or key not in fb or fa[key] != fb[key]]
