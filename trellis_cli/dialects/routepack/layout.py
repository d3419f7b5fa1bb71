"""The route pack's names on disk: the schema written into manifest.json and every layer file, the manifest's
name and a layer file's name (docs/format.md)."""

from __future__ import annotations

SCHEMA = "trellis-route-pack"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


def layer_file_name(layer: int, rank: int) -> str:
    return f"layer-{layer:03d}-rank-{rank}.safetensors"
