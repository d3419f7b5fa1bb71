"""Sources: where a checkpoint's bytes come from (a local directory, the Hub, the Hub cache).

Every later stage reads through a Source, never through paths or HTTP of its own:
- `list_files()` names every file with its size (the Hub: from the repo tree, pinned to one commit);
- `read_json(name)` reads a small JSON file (size-limited);
- `read_header(name)` parses a safetensors header without reading tensor data;
- `local_path(name)` gives a local file holding the data (a Hub source downloads it first).
A Hub source resolves its revision to a commit sha once; every read uses that sha.

This module holds the protocol and LocalSource; HubSource lives here too once written.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from trellis_cli.errors import CheckFailed, SourceUnavailable
from trellis_cli.header import Header, HeaderError, read_local_header

# config.json of a 256-expert model is a few KB; tier_bitmap.json for 76 layers is about 200 KB.
MAX_JSON_BYTES = 64 * 1024 * 1024


class Source(Protocol):
    description: str  # for reports: "local directory X" or "hub org/repo@sha"
    revision: str | None  # resolved commit sha (Hub) or None

    def list_files(self) -> dict[str, int]: ...

    def read_json(self, name: str) -> Any: ...

    def read_header(self, name: str) -> Header: ...

    def local_path(self, name: str) -> Path: ...

    def describe(self) -> dict[str, Any]: ...


def safe_relative(name: str) -> bool:
    """True when `name` stays inside the checkpoint: relative, no `..`, no backslashes or drive letters."""
    if not name or "\\" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return False
    return ".." not in PurePosixPath(name).parts


@dataclass
class LocalSource:
    """A checkpoint directory on local disk. Symlinks that leave the directory are refused."""

    root: Path
    revision: str | None = None
    description: str = ""
    _files: dict[str, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.root.exists():
            raise SourceUnavailable(f"{self.root}: no such directory")
        if not self.root.is_dir():
            raise SourceUnavailable(f"{self.root}: not a directory (a checkpoint is a directory of files)")
        self.description = self.description or f"local directory {self.root}"

    def list_files(self) -> dict[str, int]:
        if self._files is None:
            files: dict[str, int] = {}
            for dirpath, dirnames, filenames in os.walk(self.root):
                # Hidden folders (.cache/huggingface from local_dir downloads, .git) are not checkpoint content.
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for name in filenames:
                    path = Path(dirpath) / name
                    rel = path.relative_to(self.root).as_posix()
                    try:
                        files[rel] = path.stat().st_size
                    except OSError:
                        files[rel] = -1  # dangling symlink: reported by validate
            self._files = dict(sorted(files.items()))
        return self._files

    def resolve(self, name: str) -> Path:
        """The real path of `name`, refusing anything that leaves the checkpoint directory."""
        if not safe_relative(name):
            raise CheckFailed(f"{name}: path leaves the checkpoint directory")
        path = self.root / name
        real = path.resolve()
        if not real.is_relative_to(self.root.resolve()):
            raise CheckFailed(f"{name}: resolves to {real}, outside the checkpoint directory")
        return path

    def escapes(self, name: str) -> bool:
        try:
            self.resolve(name)
            return False
        except CheckFailed:
            return True

    def read_json(self, name: str) -> Any:
        path = self.resolve(name)
        if not path.is_file():
            raise SourceUnavailable(f"{name}: not found in {self.root}")
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckFailed(f"{name}: {size} bytes, larger than the {MAX_JSON_BYTES}-byte limit for JSON files")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckFailed(f"{name}: not valid JSON ({e})") from e

    def read_header(self, name: str) -> Header:
        try:
            return read_local_header(self.resolve(name), name)
        except HeaderError as e:
            raise CheckFailed(str(e)) from e

    def local_path(self, name: str) -> Path:
        return self.resolve(name)

    def describe(self) -> dict[str, Any]:
        return {"kind": "local", "path": str(self.root), "revision": None}
