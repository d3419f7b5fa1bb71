"""The robustness corpus: one function per class of malformed checkpoint, each corrupting a fresh synth copy.

Every corruptor takes the directory of a valid `tiny` TR3 checkpoint (per_expert_v1, tp 2, 8 experts, layers
3-4, mcg) and damages exactly one thing, returning the finding code validate must report for it. Corruptors
edit headers in place (same length, padded with spaces) or rebuild one small shard; they never touch
anything outside the directory except where the class itself is "a link to outside".
"""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

SHARD3 = "model-layer-003.safetensors"
SHARD4 = "model-layer-004.safetensors"
INDEX = "model.safetensors.index.json"


def key(layer: int, expert: int, proj: str, rank: int, field: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.rank{rank}.{field}"


# ---- low-level editing -------------------------------------------------------------------------------

def read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def rewrite_header(path: Path, mutate: Callable[[dict], None]) -> None:
    """Edit the header JSON in place, keeping its length (space padding) so the data stays where it is."""
    n, header = read_header(path)
    mutate(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > n:
        raise ValueError(f"{path.name}: edited header is {len(body)} bytes, more than the original {n}")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(body + b" " * (n - len(body)))


def write_tensor_bytes(path: Path, name: str, data: bytes, offset_in_tensor: int = 0) -> None:
    n, header = read_header(path)
    begin = header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(8 + n + begin + offset_in_tensor)
        f.write(data)


def rebuild_shard(root: Path, shard: str, mutate: Callable[[dict], None]) -> None:
    """Load a small shard, edit its tensor dict, write it back and make the index agree."""
    tensors = load_file(str(root / shard))
    mutate(tensors)
    save_file(tensors, str(root / shard), metadata={"format": "pt"})
    index_path = root / INDEX
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    index["metadata"]["total_size"] = sum(read_total(root / f) for f in set(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))


def read_total(path: Path) -> int:
    _, header = read_header(path)
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def edit_json(path: Path, mutate: Callable[[dict], None], **dumps) -> None:
    """The JSON file edited in place and written again by `json.dumps(**dumps)`."""
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc, **dumps))


def rewrite_index(root: Path, edit: Callable[[dict], None] = lambda _wm: None, **dumps) -> None:
    """The index's weight_map edited in place (keys keep their places), written again by `json.dumps(**dumps)`."""
    edit_json(root / INDEX, lambda doc: edit(doc["weight_map"]), **dumps)


def shuffled(weight_map: dict) -> None:
    """The weight_map's entries in an order no writer gives (a fixed shuffle)."""
    items = list(weight_map.items())
    random.Random(7).shuffle(items)
    weight_map.clear()
    weight_map.update(items)


# ---- one corruptor per class -------------------------------------------------------------------------

def truncated_shard(root: Path) -> str:
    path = root / SHARD3
    os.truncate(path, path.stat().st_size - 1000)
    return "file.truncated"


def header_length_past_end(root: Path) -> str:
    path = root / SHARD4
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", path.stat().st_size + 4096))
    return "file.header-length"


def overlapping_offsets(root: Path) -> str:
    def mutate(header: dict) -> None:
        a, b = key(3, 0, "gate_proj", 0, "suh"), key(3, 0, "gate_proj", 0, "svh")
        begin = header[a]["data_offsets"][0]
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
        header[b]["data_offsets"] = [begin, begin + size]

    rewrite_header(root / SHARD3, mutate)
    return "file.overlap"


def wrong_dtype(root: Path) -> str:
    rewrite_header(root / SHARD3, lambda h: h[key(3, 1, "up_proj", 1, "trellis")].update(dtype="F16"))
    return "tensor.dtype"


def bitmap_k_differs_from_shape(root: Path) -> str:
    def mutate(bitmap: dict) -> None:
        ks = bitmap["3"]["k"]
        ks[0] = 4 if ks[0] == 3 else 3

    edit_json(root / "tier_bitmap.json", mutate)
    return "tensor.k-mismatch"


def missing_expert(root: Path) -> str:
    rebuild_shard(root, SHARD3, lambda t: [t.pop(k) for k in list(t) if ".experts.5." in k])
    return "expert.missing"


def missing_rank(root: Path) -> str:
    rebuild_shard(root, SHARD4, lambda t: [t.pop(k) for k in list(t) if ".experts.2.up_proj.rank1." in k])
    return "rank.missing"


def nan_in_suh(root: Path) -> str:
    write_tensor_bytes(root / SHARD3, key(3, 4, "down_proj", 0, "suh"), torch.tensor([float("nan")],
                                                                                    dtype=torch.float16).numpy().tobytes(), 6)
    return "data.nonfinite"


def wrong_marker_value(root: Path) -> str:
    write_tensor_bytes(root / SHARD4, key(4, 7, "gate_proj", 1, "mcg"), struct.pack("<i", 12345))
    return "marker.value"


def both_markers(root: Path) -> str:
    mul1 = torch.tensor(-2082680531, dtype=torch.int32)
    rebuild_shard(root, SHARD3, lambda t: t.update({key(3, 3, "down_proj", 1, "mul1"): mul1}))
    return "marker.both"


def index_entry_outside(root: Path) -> str:
    def mutate(index: dict) -> None:
        index["weight_map"][key(3, 0, "gate_proj", 0, "trellis")] = "../outside.safetensors"

    edit_json(root / INDEX, mutate)
    return "path.escape"


def symlink_escape(root: Path) -> str:
    outside = root.parent / f"{root.name}-outside.safetensors"
    os.replace(root / SHARD4, outside)
    os.symlink(outside, root / SHARD4)
    return "path.escape"


def duplicate_tensor(root: Path) -> str:
    name = key(3, 6, "gate_proj", 0, "svh")
    twin = load_file(str(root / SHARD3))[name].clone()
    save_file({name: twin}, str(root / "model-extra.safetensors"), metadata={"format": "pt"})
    return "tensor.duplicate"


def unknown_dialect(root: Path) -> str:
    def mutate(config: dict) -> None:
        config.pop("hybrid_tr3_tail")
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}

    edit_json(root / "config.json", mutate)
    return "dialect.unknown"


def bitmap_extra_expert(root: Path) -> str:
    edit_json(root / "tier_bitmap.json", lambda b: b["4"]["k"].append(3))
    return "bitmap.length"


CORPUS: dict[str, tuple[Callable[[Path], str], bool]] = {  # name -> (corruptor, needs --deep)
    "truncated-shard": (truncated_shard, False),
    "header-length-past-end": (header_length_past_end, False),
    "overlapping-offsets": (overlapping_offsets, False),
    "wrong-dtype": (wrong_dtype, False),
    "bitmap-k-differs": (bitmap_k_differs_from_shape, False),
    "missing-expert": (missing_expert, False),
    "missing-rank": (missing_rank, False),
    "nan-in-suh": (nan_in_suh, True),
    "wrong-marker-value": (wrong_marker_value, False),  # loaders read markers at load: so does the default
    "both-markers": (both_markers, False),
    "index-entry-outside": (index_entry_outside, False),
    "symlink-escape": (symlink_escape, False),
    "duplicate-tensor": (duplicate_tensor, False),
    "unknown-dialect": (unknown_dialect, False),
    "bitmap-extra-expert": (bitmap_extra_expert, False),
}


# ---- what every reader of checkpoint bytes must refuse by name (issue: one checkpoint reader) ---------------
# Each damages a valid `tiny` copy (MANIFEST.sha256 removed first by the caller when it matters) and returns the
# finding code that fit, diff and inspect --tensors name, as validate does.

def write_header(path: Path, header: dict, *, text: str | None = None) -> None:
    """Replace the header of a shard by `header` (or by the JSON `text` given), of any length; the data stays."""
    n, _ = read_header(path)
    data = path.read_bytes()[8 + n:]
    body = (text if text is not None else json.dumps(header, separators=(",", ":"))).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def shard_is_fifo(root: Path) -> str:
    (root / SHARD4).unlink()
    os.mkfifo(root / SHARD4)
    return "path.special"


def shard_is_directory(root: Path) -> str:
    (root / SHARD4).unlink()
    (root / SHARD4).mkdir()
    return "index.file-missing"


def shard_is_symlink_loop(root: Path) -> str:
    (root / SHARD4).unlink()
    os.symlink(SHARD4, root / SHARD4)
    return "path.dangling"


def shard_missing_but_indexed(root: Path) -> str:
    (root / SHARD4).unlink()
    return "index.file-missing"


def header_length_2_63(root: Path) -> str:
    with open(root / SHARD4, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 63))
    return "file.header-length"


def extra_shard_not_utf8(root: Path) -> str:
    body = b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    (root / "model-extra.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + b"\0")
    return "file.header"


def tensor_runs_past_the_file(root: Path) -> str:
    """A 700 KB shard whose last tensor declares 412 GB."""
    _, header = read_header(root / SHARD4)
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    begin = header[name]["data_offsets"][0]
    header[name]["shape"] = [412 * 10**9 // 2]
    header[name]["dtype"] = "I16"
    header[name]["data_offsets"] = [begin, begin + 412 * 10**9]
    write_header(root / SHARD4, header)
    return "file.truncated"


READER_CORPUS: dict[str, Callable[[Path], str]] = {
    "shard-fifo": shard_is_fifo,
    "shard-directory": shard_is_directory,
    "shard-symlink-loop": shard_is_symlink_loop,
    "shard-missing-indexed": shard_missing_but_indexed,
    "header-length-2^63": header_length_2_63,
    "extra-shard-not-utf8": extra_shard_not_utf8,
    "tensor-past-the-file": tensor_runs_past_the_file,
}
