"""manifest.json of a route-pack directory: build, write canonically, read back, and hash files.

The manifest is written as `json.dumps(doc, indent=2) + "\\n"` and carries `manifest_sha256`, the sha256 of
that same serialization without the key. A reader re-serializes what it parsed: a changed byte anywhere
in the file either breaks the JSON, breaks the canonical form, or changes the content and so the hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trellis_cli.errors import CheckFailed, SourceUnavailable
from trellis_cli.header import JsonError, load_json, open_regular, os_reason, safe_relative
from trellis_cli.integrity import sha256_file
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME, SCHEMA, SCHEMA_VERSION
from trellis_cli.sources import MAX_JSON_BYTES, read_json_file

SELF_HASH_KEY = "manifest_sha256"


def file_entry(path: Path, **extra: Any) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "size": path.stat().st_size, **extra}


def serialize(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"


def self_hash(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != SELF_HASH_KEY}
    return hashlib.sha256(serialize(body).encode("utf-8")).hexdigest()


def write_manifest(directory: Path, doc: dict[str, Any], name: str = MANIFEST_NAME) -> Path:
    """Write atomically (temporary name, fsync, rename); adds the self hash as the last key."""
    doc = {k: v for k, v in doc.items() if k != SELF_HASH_KEY}
    doc[SELF_HASH_KEY] = self_hash(doc)
    path = directory / name
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(serialize(doc))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(directory: Path, name: str = MANIFEST_NAME) -> tuple[dict[str, Any], list[str]]:
    """(document, integrity problems). Raises CheckFailed only when there is no usable JSON object."""
    path = directory / name
    try:  # never a FIFO or a device, never more than the JSON limit (the manifest is untrusted input)
        with open_regular(path) as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise CheckFailed(f"{name}: cannot be read ({os_reason(e)})") from e
    if len(raw) > MAX_JSON_BYTES:
        raise CheckFailed(f"{name}: larger than the {MAX_JSON_BYTES}-byte limit for JSON files")
    try:
        doc = load_json(raw)
    except JsonError as e:
        raise CheckFailed(f"{name}: {e}") from e
    text = raw.decode("utf-8")
    if not isinstance(doc, dict):
        raise CheckFailed(f"{name}: a JSON {type(doc).__name__}, expected an object")
    problems = []
    if serialize(doc) != text:
        problems.append("the file is not in the canonical form it was written in (bytes changed)")
    if doc.get(SELF_HASH_KEY) != self_hash(doc):
        problems.append(f"{SELF_HASH_KEY} does not match the content (content changed)")
    return doc, problems


def safe_name(name: Any) -> bool:
    """A file name a manifest may carry: a string naming a path inside the directory (nothing else is opened)."""
    return isinstance(name, str) and safe_relative(name)  # safe_relative also refuses NUL


def is_route_pack(directory: str | Path) -> bool:
    """True when `directory` holds a manifest.json whose schema is the route pack's."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        doc = read_json_file(path, MANIFEST_NAME)
    except (CheckFailed, SourceUnavailable):
        return False
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


def declared_layers(doc: Any) -> list[int]:
    """The MoE layers a manifest declares (its canonical decimal `layers` keys), for --layers selections."""
    from trellis_cli.id_ranges import parse_id

    layers = doc.get("layers") if isinstance(doc, dict) else None
    ids = (parse_id(key) for key in layers) if isinstance(layers, dict) else ()
    return sorted(i for i in ids if i is not None)


def base_document(source: dict[str, Any], geometry: dict[str, Any], tp: int, ranks: list[int], codebook: str,
                  rotation: str) -> dict[str, Any]:
    from trellis_cli import __version__

    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "producer": f"trellis {__version__} repack",
        "source": source,
        "geometry": geometry,
        "tp": tp,
        "ranks": ranks,
        "codebook": codebook,
        "rotation": rotation,
        "layers": {},
        "files": {},
    }
