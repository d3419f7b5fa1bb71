"""What a repack knows about its source, shared by every driver: which files it uses, their sha256 (each computed
once), the fingerprint a resumed stage must match, and how the source stores rotation vectors.

`source_paths` lists what OUT must never overlap: the source directory and the real files its names lead to
(links included); for a Hub source also the repo's snapshot, the cache root and the Hub's home folders
(HF_HOME, HF_HUB_CACHE), since `--overwrite` deletes OUT and a stage is deleted and rebuilt.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.checkpoint.names import is_expert_name
from trellis_cli.errors import CheckFailed
from trellis_cli.header import safe_relative
from trellis_cli.integrity import CHECKSUM_MANIFEST, read_manifest, sha256_file
from trellis_cli.sources import LocalSource, Source

CONFIG = "config.json"
NOT_COPIED = (CHECKSUM_MANIFEST,)  # source-side hashes; the manifest replaces them


def source_root(checkpoint: Checkpoint) -> Path | None:
    return checkpoint.source.root


def protected_paths(checkpoint: Checkpoint) -> list[Path]:
    """What OUT may not overlap: the source directory, the real files its names lead to, a Hub cache."""
    return source_paths(checkpoint.source, list(checkpoint.files))


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
    wait for it: never a pool task waiting on a queued one), and each checked against the hash the source
    itself records for the file (recorded_hashes): a mismatch is refused, so a conversion never re-hashes
    corrupt bytes as good."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.ck = checkpoint
        self.done: dict[str, str] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._recorded: dict[str, list[tuple[str, str, str]]] | None = None

    def get(self, name: str) -> str:
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            if name not in self.done:
                digest = sha256_file(self.ck.source.local_path(name))
                self._check(name, digest)
                self.done[name] = digest
            return self.done[name]

    def _check(self, name: str, digest: str) -> None:
        with self._guard:
            if self._recorded is None:
                self._recorded = recorded_hashes(self.ck)
        for expected, authority, code in [*self._recorded.get(name, ()), *_hub_hash(self.ck, name)]:
            if digest != expected:
                raise CheckFailed(f"[{code}] {name}: sha256 {digest} differs from {authority} ({expected}); the "
                                  f"source file is corrupt or changed: refusing to convert it (nothing written to "
                                  f"OUT)", code=code)

    def check_copy(self, name: str, copy: Path) -> None:
        """A carried copy must hash to what its (verified) source file hashed to."""
        if sha256_file(copy) != self.get(name):
            raise CheckFailed(f"{name}: the copy differs from the source file (did it change during the repack?)")

    def of(self, names) -> dict[str, str]:
        return {n: self.get(n) for n in sorted(names)}


def recorded_hashes(checkpoint: Checkpoint) -> dict[str, list[tuple[str, str, str]]]:
    """name -> [(sha256, who records it, finding code)]: what the dialect's own metadata records
    (`Dialect.source_digests`: the exl3-v1 manifest's layer digests) and a local MANIFEST.sha256's lines."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    for name, recorded in dialect_of(checkpoint).source_digests(checkpoint).items():
        out.setdefault(name, []).extend(recorded)
    if isinstance(checkpoint.source, LocalSource):
        loaded = read_manifest(checkpoint.source)
        for name, digest in (loaded[0] if loaded is not None else {}).items():
            out.setdefault(name, []).append((digest, CHECKSUM_MANIFEST, "checksum.mismatch"))
    return out


def _hub_hash(checkpoint: Checkpoint, name: str) -> list[tuple[str, str, str]]:
    """The sha256 the Hub lists for an LFS file (git blob ids of small files are not sha256: not compared)."""
    info = checkpoint.source.file_info(name)
    known = info.lfs_sha256 if info is not None else None
    return [(known, "the Hub's LFS sha256", "checksum.mismatch")] if known else []


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


def source_paths(source: Source, names: Iterable[str] = ()) -> list[Path]:
    """Every path OUT must not equal, lie inside or contain: the source's directory, the real targets of `names`
    (its files, links followed), and for a Hub source its snapshot, the cache root, HF_HOME and HF_HUB_CACHE."""
    from trellis_cli.sources import HubSource

    paths: list[Path] = []
    root = source.root
    if root is not None:
        paths.append(root)
        paths += [Path(os.path.realpath(root / n)) for n in names if safe_relative(n)]
    if isinstance(source, HubSource):
        from trellis_cli import hub_client

        cache_dir = source.cache_dir
        paths.append(hub_client.cache_root(cache_dir))
        folder = hub_client.repo_cache_folder(source.repo_id, cache_dir)
        paths += [folder, folder / "snapshots" / str(source.revision or "")]
        paths += _hub_homes(hub_client.hf_constants)
        for name in names:
            found = source.cached_path(name) if safe_relative(name) else None
            if found is not None:
                paths.append(Path(os.path.realpath(found)))
    return paths


def _hub_homes(constants) -> list[Path]:
    """HF_HOME and HF_HUB_CACHE as the environment names them now and as the library read them at import."""
    found = [os.environ.get("HF_HOME"), os.environ.get("HF_HUB_CACHE"), getattr(constants, "HF_HOME", None),
             getattr(constants, "HF_HUB_CACHE", None)]
    return [Path(p).expanduser() for p in found if p]
