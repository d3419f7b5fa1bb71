"""The staging directory of a repack: safety checks, resume state, free space, and the final move.

Output is built in `OUT.partial` (next to OUT, so the final `os.replace` is a same-filesystem rename) and
moved into place only when complete and verified. A state file records every finished output file with
its sha256; a rerun with the same source and options skips files that still hash to the recorded value,
so an interrupted repack resumes instead of starting over. Nothing is ever written into the source.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from trellis_cli.errors import CheckFailed, TrellisError, UsageError
from trellis_cli.repack.manifest import sha256_file

STATE_NAME = ".repack-state.json"
STAGE_SUFFIX = ".partial"
HEADROOM_BYTES = 64 << 20  # headers, JSON files, the manifest, temporary names


def stage_path(out: Path) -> Path:
    """OUT.partial, next to OUT as given (not resolved), so the final rename stays on one filesystem."""
    out = out.absolute()
    return out.with_name(out.name + STAGE_SUFFIX)


def check_target(out: Path, source_root: Path | None, overwrite: bool) -> None:
    """Refuse an OUT that is (inside) the source, contains the source, is a file, or is non-empty, and an
    OUT.partial that holds the source or is not a plain directory: the stage is deleted and rebuilt."""
    stage = stage_path(out)
    out = out.resolve()
    if source_root is not None:
        src = source_root.resolve()
        if out == src or out.is_relative_to(src):
            raise UsageError(f"{out}: is inside the source checkpoint {src}; refusing to write into the source")
        if src.is_relative_to(out):
            raise UsageError(f"{out}: contains the source checkpoint {src}; refusing to replace it")
        real_stage = stage.resolve()
        if real_stage == src or src.is_relative_to(real_stage) or real_stage.is_relative_to(src):
            raise UsageError(f"{stage}: the staging directory of {out} overlaps the source checkpoint {src}; "
                             f"refusing (it is deleted and rebuilt); choose another OUT or move the source")
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        what = "a symbolic link" if stage.is_symlink() else "not a directory"
        raise UsageError(f"{stage}: the staging directory of {out} exists and is {what} (remove it)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"{out}: exists and is not empty (pass --overwrite to replace it)")


def check_free_space(out: Path, needed: int) -> None:
    """Checked up front, so a long repack does not die at 95 % on a full disk."""
    probe = out.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed + HEADROOM_BYTES:
        raise CheckFailed(f"{out}: {free / 1e9:.2f} GB free on its filesystem, the repack needs "
                          f"{(needed + HEADROOM_BYTES) / 1e9:.2f} GB")


def _refuse_links(stage: Path) -> None:
    """A stage to resume holds only what repack wrote: plain files and folders. Writing config.json or a copied
    file through a link planted there would change a file outside OUT before the final check saw the link."""
    for path in sorted(stage.rglob("*")):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise UsageError(f"{path}: the staging directory holds a link or a special file that repack did not "
                             f"write; refusing to resume (remove {stage} and rerun)")


class Stage:
    """OUT.partial and its resume state. Thread-safe `record`."""

    def __init__(self, out: Path, fingerprint: dict[str, Any], overwrite: bool) -> None:
        self.out = out.absolute()
        self.path = stage_path(out)
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self.done: dict[str, dict[str, Any]] = {}
        self.resumed = False
        self._open(overwrite)

    def _open(self, overwrite: bool) -> None:
        state_path = self.path / STATE_NAME
        if self.path.exists():
            state = _read_state(state_path)
            if state is None and not overwrite:
                raise UsageError(f"{self.path}: exists and was not made by trellis repack (remove it or pass "
                                 f"--overwrite)")
            if state is not None and state.get("fingerprint") == self.fingerprint:
                _refuse_links(self.path)
                self.done = dict(state.get("files", {}))
                self.resumed = True
            else:
                shutil.rmtree(self.path)  # ours, from a run with other options or another source
        if not self.resumed:
            self.path.mkdir(parents=True)
            self._save()

    def completed(self, name: str) -> bool:
        """True when `name` was finished by an earlier run and still hashes to what was recorded."""
        entry = self.done.get(name)
        path = self.path / name
        if entry is None or not path.is_file() or path.stat().st_size != entry.get("size"):
            return False
        return sha256_file(path) == entry.get("sha256")

    def record(self, name: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self.done[name] = entry
            self._save()

    def _save(self) -> None:
        path = self.path / STATE_NAME
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "files": self.done}, indent=1), encoding="utf-8")
        os.replace(tmp, path)

    @contextmanager
    def discard_on_refusal(self) -> Iterator[None]:
        """A refusal (bad data, an inexact conversion) would recur on a rerun: drop the stage. Anything else
        (an interruption, a full disk, a crash) keeps it, so the rerun resumes."""
        try:
            yield
        except TrellisError:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def bytes_done(self) -> int:
        return sum(int(e.get("size", 0)) for e in self.done.values())

    def move_into_place(self) -> Path:
        """Replace OUT by the finished stage (an existing OUT was checked empty or --overwrite given)."""
        (self.path / STATE_NAME).unlink(missing_ok=True)
        for leftover in self.path.rglob("*.partial"):
            leftover.unlink()
        old = None
        if self.out.exists():
            old = self.out.with_name(f"{self.out.name}.replaced-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.path, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) else None
