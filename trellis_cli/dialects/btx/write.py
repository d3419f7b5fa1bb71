"""Writing one spelling of the container from the other: BTX <-> exl3-v1 by renaming only.

A layer file keeps every tensor's bytes, dtype and shape; only its tensor names (`atoms` / `codes`,
`rotation_draws` / `sign_pattern`) and its metadata (schema, codebook, `atom_channels` / `slot_channels`) are
renamed, with the metadata keys in their order and the header laid out as safetensors' writer does. Both
spellings sort their tensors the same way (codes|atoms < rates_fc1 < rates_fc2 < sign_pattern|rotation_draws
among the u8 tensors), so the data section is the same bytes at the same offsets. The manifest is the source
document renamed key by key, with each layer's new file name and sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from trellis_cli.dialects.btx import names
from trellis_cli.errors import CheckFailed
from trellis_cli.header import read_local_header
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter

CHUNK = 16 << 20  # bytes copied per read: a production layer's codes are GiB

Rename = Callable[[str], str]


def renamers(to_btx: bool) -> tuple[Rename, Callable[[dict], dict], Callable[[Any], Any], Rename]:
    """(tensor name, layer metadata, manifest document, layer file name), each into the target spelling."""
    if to_btx:
        return names.tensor_as_btx, names.metadata_as_btx, names.manifest_as_btx, names.layer_file_as_btx
    return (names.tensor_as_exl3v1, lambda m: names.metadata_as_exl3v1(m) or {}, names.manifest_as_exl3v1,
            names.layer_file_as_exl3v1)


def write_renamed_layer(source: Path, target: Path, to_btx: bool, on_bytes: Callable[[int], None]) -> str:
    """Copy one layer file under the other spelling's names; the sha256 of the written file.

    Every tensor's bytes are read back from `target` and compared with `source` (a difference is a refusal:
    the conversion is renaming only)."""
    tensor_name, metadata, _, _ = renamers(to_btx)
    header = read_local_header(source, source.name)
    plan = [PlannedTensor(tensor_name(n), e.dtype, tuple(e.shape)) for n, e in header.tensors.items()]
    with open(source, "rb") as src, SafetensorsWriter(target, plan, metadata(dict(header.metadata))) as writer:
        for name, entry in header.tensors.items():
            writer.write_parts(tensor_name(name), _chunks(src, header.data_start + entry.begin,
                                                          entry.end - entry.begin, on_bytes))
    _same_payload(source, target, tensor_name)
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _chunks(f, offset: int, length: int, on_bytes: Callable[[int], None]):
    f.seek(offset)
    while length > 0:
        block = f.read(min(CHUNK, length))
        if not block:
            raise CheckFailed(f"{Path(f.name).name}: the file ends inside a tensor")
        length -= len(block)
        on_bytes(len(block))
        yield block


def _digest(path: Path, offset: int, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in _chunks(f, offset, length, lambda _n: None):
            digest.update(block)
    return digest.hexdigest()


def _same_payload(source: Path, target: Path, tensor_name: Rename) -> None:
    a, b = read_local_header(source, source.name), read_local_header(target, target.name)
    for name, e in a.tensors.items():
        t = b.tensors.get(tensor_name(name))
        if t is None or (t.dtype, t.shape) != (e.dtype, e.shape) or _digest(
                source, a.data_start + e.begin, e.end - e.begin) != _digest(target, b.data_start + t.begin,
                                                                            t.end - t.begin):
            raise CheckFailed(f"{target.name}: tensor {tensor_name(name)} read back differs from {name} of "
                              f"{source.name}")


def renamed_manifest(doc: dict[str, Any], to_btx: bool, layers: dict[int, tuple[str, str]]) -> dict[str, Any]:
    """The source manifest under the target names, its layers (and moe_layer_indices) those of `layers`
    (index -> (file, sha256))."""
    _, _, manifest, _ = renamers(to_btx)
    out = manifest(doc)
    out["layers"] = {str(i): {"file": f, "sha256": s} for i, (f, s) in sorted(layers.items())}
    geometry = dict(out["geometry"])
    if sorted(geometry.get("moe_layer_indices", [])) != sorted(layers):  # a --layers subset
        geometry["moe_layer_indices"] = sorted(layers)
    out["geometry"] = geometry
    return out


def write_manifest(directory: Path, doc: dict, to_btx: bool) -> Path:
    """Atomically, as JSON with sorted keys, indent 2 and a trailing newline (as b12x's writers do)."""
    path = directory / (names.MANIFEST_FILE if to_btx else names.EXL3V1_MANIFEST)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
