"""The declarations of two checkpoints, key by key: model facts, config.json, quantization metadata, manifests.

Nested objects are compared leaf by leaf under dotted keys (`hybrid_tr3_tail.tp`); lists are compared whole.
Only JSON the model already read (or the small JSON files its dialect names) is used.
"""

from __future__ import annotations

from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.diff.result import StructureChange

FACTS = ("dialect", "tp", "codebook", "rotation_layout", "hidden", "intermediate", "num_experts")
MISSING = None  # a key absent on one side is shown as null


def structure_changes(a: Checkpoint, b: Checkpoint) -> list[StructureChange]:
    fa, fb = model_facts(a), model_facts(b)
    changes = [StructureChange("checkpoint", name, fa[name], fb[name]) for name in FACTS if fa[name] != fb[name]]
    docs_a, docs_b = _documents(a), _documents(b)
    for what in sorted(docs_a.keys() | docs_b.keys()):
        changes += _keyed(what, docs_a.get(what), docs_b.get(what))
    return changes


def model_facts(ck: Checkpoint) -> dict[str, Any]:
    """The model's facts, with what the dialect's own metadata gives where the model leaves it open (a route
    pack's geometry and rotation layout from its manifest; no stored TP for an exl3-v1, whose rank is a slot
    extent)."""
    facts = {name: getattr(ck, name) for name in FACTS}
    facts.update(dialect_of(ck).model_facts(ck))
    return facts


def _documents(ck: Checkpoint) -> dict[str, Any]:
    """The JSON that declares the side, as its dialect names it (an unreadable file shows as absent: it is
    validate's finding)."""
    return dialect_of(ck).declaration_documents(ck)


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
