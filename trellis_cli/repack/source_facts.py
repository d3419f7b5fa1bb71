"""What a repack knows about its source, shared by every driver: which files it uses, their sha256 (each computed
once), the fingerprint a resumed stage must match, and how the source stores rotation vectors.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.names import is_expert_name
from trellis_cli.integrity import CHECKSUM_MANIFEST
from trellis_cli.routepack import manifest as mf

CONFIG = "config.json"
NOT_COPIED = (CHECKSUM_MANIFEST,)  # source-side hashes; the manifest replaces them


def source_root(checkpoint: Checkpoint) -> Path | None:
    root = getattr(checkpoint.source, "root", None)
    return Path(root) if root is not None else None


def fingerprint(checkpoint: Checkpoint, options: Any, used: list[str]) -> dict[str, Any]:
    """What must be unchanged for the stage to be resumed at all: the source (files, sizes, mtimes) and options.
    Each staged file is also tied to the sha256 of the source files it was made from (Stage.record)."""
    files = {}
    for name in used:
        entry: dict[str, Any] = {"size": checkpoint.files.get(name)}
        root = source_root(checkpoint)
        if root is not None:
            entry["mtime_ns"] = (root / name).stat().st_mtime_ns
        files[name] = entry
    opts = {k: getattr(options, k) for k in ("layers", "ranks", "tp", "shared_h", "to", "copy_other")}
    return {"source": checkpoint.source.describe(), "files": files, "options": opts}


def used_source_files(checkpoint: Checkpoint, layers: list[int], copy_other: bool) -> list[str]:
    used = {f for layer in layers for f in checkpoint.layers[layer].files}
    for name in checkpoint.files:
        if not name.endswith(".safetensors") and name not in NOT_COPIED and (copy_other or name == CONFIG):
            used.add(name)
    if copy_other:
        used.update(n for n in checkpoint.headers if not has_experts(checkpoint, n) or
                    not all(map(is_expert_name, checkpoint.headers[n].tensors)))
    return sorted(n for n in used if not n.endswith(".safetensors.index.json"))


class SourceHashes:
    """sha256 of source files, each computed once however many threads ask (the first one hashes, the others
    wait for it: never a pool task waiting on a queued one)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.ck = checkpoint
        self.done: dict[str, str] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, name: str) -> str:
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            if name not in self.done:
                self.done[name] = source_sha256(self.ck, name)
            return self.done[name]

    def of(self, names) -> dict[str, str]:
        return {n: self.get(n) for n in sorted(names)}


def source_sha256(checkpoint: Checkpoint, name: str) -> str:
    info = getattr(checkpoint.source, "file_info", None)
    if info is not None:
        known = getattr(info(name), "lfs_sha256", None)
        if known:
            return known  # the Hub states it; the download is checked against it
    return mf.sha256_file(checkpoint.source.local_path(name))


def vector_ndim(checkpoint: Checkpoint) -> dict[str, int]:
    """How the source stores rotation vectors ([n] or [1, n]), so --to tr3 can restore the exact shapes."""
    out = {"per_expert": 1, "shared_h": 1}
    for moe in checkpoint.layers.values():
        for projs in moe.experts.values():
            for ranks in projs.values():
                for lin in ranks.values():
                    ref = lin.svh if lin.svh is not None else lin.suh
                    if ref is not None:
                        out["per_expert"] = len(ref.shape)
                        break
                break
            break
        for vectors in moe.shared_h.values():
            for ref in vectors.values():
                out["shared_h"] = len(ref.shape)
        if moe.experts:
            break
    return out


def has_experts(checkpoint: Checkpoint, file: str) -> bool:
    header = checkpoint.headers.get(file)
    return header is not None and any(map(is_expert_name, header.tensors))
