"""What identifies a route pack (detection) and what opening keeps of it: its manifest.json.

Decided from the listing before config.json is read: a pack's config.json is one of its hashed files, so a
damaged one is the route-pack verifier's finding, not a reason to stop (`Dialect.opens_from_listing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trellis_cli.checkpoint.model import DIALECT_ROUTE_PACK, Checkpoint, Declarations
from trellis_cli.dialects.interface import DialectInfo, Probe, declared_tp
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME


@dataclass
class RoutePackDeclarations(Declarations):
    """manifest.json, an object whose schema is the route pack's."""

    manifest: dict[str, Any]


def detect_route_pack(probe: Probe) -> DialectInfo | None:
    """The route-pack dialect when `manifest.json` says so, else None; reads no config.json."""
    if MANIFEST_NAME not in probe.files:
        return None
    manifest = probe.read_json(MANIFEST_NAME)
    if isinstance(manifest, dict) and manifest.get("schema") == DIALECT_ROUTE_PACK:
        return DialectInfo(DIALECT_ROUTE_PACK, "n/a", declared_tp(manifest.get("tp")), manifest.get("codebook"),
                           RoutePackDeclarations(manifest))
    return None


def manifest_of(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The route pack's manifest.json as opening read it; None for any other checkpoint."""
    declared = ckpt.declared
    return declared.manifest if isinstance(declared, RoutePackDeclarations) else None
