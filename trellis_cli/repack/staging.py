"""The staging directory of a repack: safety checks, resume state, free space, and the final move.

Output is built in `OUT.partial/tree` (next to OUT, so the final `os.replace` is a same-filesystem rename) and
moved into place only when complete and verified. The resume state, `OUT.partial/state.json`, lies outside
the tree, so no file carried from the source can collide with it. It records every finished output file
with its sha256 and the sha256 of each source file it was made from; a rerun with the same source and
options reuses a staged file only when both still match, so an interrupted repack resumes instead of
starting over, and never keeps a file made from bytes that have since changed. Nothing is ever written
into the source.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from trellis_cli.disk_space import free_bytes, space_refusal
from trellis_cli.errors import CheckFailed, TrellisError, UsageError
from trellis_cli.repack.lock import StageLock
from trellis_cli.repack.out_paths import check_overlap
from trellis_cli.dialects.conversion import output_path
from trellis_cli.integrity import sha256_file

STATE_NAME = "state.json"  # in OUT.partial, beside the tree
TREE_NAME = "tree"  # OUT.partial/tree becomes OUT
STAGE_SUFFIX = ".partial"
STAGE_VERSION = 2  # part of every fingerprint: a stage written under other rules is never resumed


def stage_path(out: Path) -> Path:
    """OUT.partial, next to OUT as given (not resolved), so the final rename stays on one filesystem."""
    out = out.absolute()
    return out.with_name(out.name + STAGE_SUFFIX)


def check_target(out: Path, source_root: Path | Iterable[Path] | None, overwrite: bool) -> None:
    """Refuse an OUT that is (inside) the source, contains the source, is a file, a symbolic link or non-empty,
    and an OUT.partial that holds the source or is not a plain directory: the stage is deleted and rebuilt.
    `source_root`: the source directory, or every path of the source (out_paths.source_paths)."""
    stage = stage_path(out)
    if out.absolute().is_symlink():
        # Replacing OUT renames it aside and deletes it: through a link that would leave the link and the
        # directory it points at behind, outside OUT. Repack writes a directory, never through a link.
        raise UsageError(f"{out}: is a symbolic link (to {os.readlink(out.absolute())}); repack writes OUT as a "
                         f"directory of its own: name the directory itself, or remove the link")
    refuse_overlap(out, source_root)
    StageLock(stage, out).refuse_unusable()  # a FIFO or a link under the lock's name: the lock refuses it
    out = out.resolve()
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        what = "a symbolic link" if stage.is_symlink() else "not a directory"
        raise UsageError(f"{stage}: the staging directory of {out} exists and is {what} (remove it)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"{out}: exists and is not empty (pass --overwrite to replace it)")


def refuse_overlap(out: Path, source_root: Path | Iterable[Path] | None) -> None:
    """OUT, OUT.partial and OUT.partial.lock apart from every path of the source: checked before the lock file
    is created (next to OUT) and again in check_target."""
    protected = [] if source_root is None else [source_root] if isinstance(source_root, Path) else list(source_root)
    stage = stage_path(out)
    check_overlap(out, stage, protected, stage.with_name(stage.name + ".lock"))


def check_free_space(out: Path, needed: int) -> None:
    """Checked up front, so a long repack does not die at 95 % on a full disk."""
    refusal = space_refusal(out, free_bytes(out), needed, "the repack")
    if refusal:
        raise CheckFailed(refusal)


def staged_files(out: Path) -> tuple[int, int]:
    """(files, bytes) verified and recorded in OUT.partial so far; (0, 0) without a readable stage."""
    state = _read_state(stage_path(out) / STATE_NAME)
    files = state.get("files") if state is not None else None
    if not isinstance(files, dict):
        return 0, 0
    return len(files), sum(int(e.get("size", 0)) for e in files.values() if isinstance(e, dict))


def resumable_bytes(out: Path, fingerprint: dict[str, Any]) -> int:
    """Bytes a run with `fingerprint` would resume from OUT.partial rather than write again (read only)."""
    state = _read_state(stage_path(out) / STATE_NAME)
    if state is None or state.get("fingerprint") != {"stage_version": STAGE_VERSION, **fingerprint}:
        return 0
    return staged_files(out)[1]


def why_not_resumed(old: Any, new: dict[str, Any]) -> str:
    """What differs between a stage's fingerprint and this run's: the reason its files are discarded."""
    if not isinstance(old, dict):
        return "its record is unreadable"
    if old.get("stage_version") != new.get("stage_version"):
        return "it was made by another version of trellis"
    old_opts, new_opts = old.get("options") or {}, new.get("options") or {}
    changed = [k for k in sorted(set(old_opts) | set(new_opts)) if old_opts.get(k) != new_opts.get(k)]
    if changed:
        return "it was made with other options (" + ", ".join(
            f"{k}: {_shown_option(old_opts.get(k))} then, {_shown_option(new_opts.get(k))} now"
            for k in changed) + ")"
    if old.get("source") != new.get("source"):
        return "it was made from another source"
    if old.get("files") != new.get("files"):
        return "source files changed since (size or modification time)"
    return "its fingerprint differs"


def _shown_option(value: Any) -> str:
    """An option as the user typed it: id lists as ranges (`3-5,40`), anything else as Python shows it."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        from trellis_cli.id_ranges import compact_ranges

        return repr(compact_ranges(value))
    return repr(value)


def _refuse_links(stage: Path) -> None:
    """A stage to resume holds only what repack wrote: plain files and folders. Writing config.json or a copied
    file through a link planted there would change a file outside OUT before the final check saw the link."""
    for path in sorted(stage.rglob("*")):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise UsageError(f"{path}: the staging directory holds a link or a special file that repack did not "
                             f"write; refusing to resume (remove {stage} and rerun)")


class Stage:
    """OUT.partial: `path` is the tree that becomes OUT, `root` holds it and the resume state. Thread-safe
    `record`. Hold the StageLock of OUT (lock.py) for the Stage's whole life."""

    def __init__(self, out: Path, fingerprint: dict[str, Any], overwrite: bool) -> None:
        self.out = out.absolute()
        self.root = stage_path(out)
        self.path = self.root / TREE_NAME
        self.fingerprint = {"stage_version": STAGE_VERSION, **fingerprint}
        self._lock = threading.Lock()
        self.done: dict[str, dict[str, Any]] = {}
        self.resumed = False
        self.discarded: str | None = None  # "N file(s), X GB: <why>" when an earlier stage was thrown away
        self._open(overwrite)

    def _open(self, overwrite: bool) -> None:
        if self.root.exists():
            state = _read_state(self.root / STATE_NAME)
            if state is None and not overwrite:
                raise UsageError(f"{self.root}: exists and was not made by trellis repack (remove it or pass "
                                 f"--overwrite)")
            if state is not None and state.get("fingerprint") == self.fingerprint and self.path.is_dir():
                _refuse_links(self.root)
                self.done = dict(state.get("files", {}))
                self.resumed = True
                self._prune()
            else:  # ours, from a run with other options or another source: said, then removed
                if state is not None:
                    files, size = staged_files(self.out)
                    self.discarded = (f"{files} staged file(s), {size / 1e9:.2f} GB, discarded: "
                                      f"{why_not_resumed(state.get('fingerprint'), self.fingerprint)}")
                shutil.rmtree(self.root)
        if not self.resumed:
            self.path.mkdir(parents=True)
            self._save()

    def _prune(self) -> None:
        """Keep only recorded files: what a killed run left half-done (temporary names, copies) goes."""
        for path in sorted(self.path.rglob("*"), reverse=True):  # children before their folders
            rel = path.relative_to(self.path).as_posix()
            if path.is_dir():
                if not any(path.iterdir()):
                    path.rmdir()
            elif rel not in self.done:
                path.unlink()

    def file(self, name: str, what: str = "output file") -> Path:
        """Where a dialect's writer puts `name`: a plain name under the staged tree (conversion.output_path), its
        folder made.
        This is what a writer is handed (dialects.interface.StagedOutput); lock, resume and the move stay here."""
        path = output_path(self.path, name, what)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def completed(self, name: str, sources: dict[str, str]) -> bool:
        """True when `name` was finished by an earlier run from source files whose sha256 were `sources`, and
        still hashes to what was recorded."""
        entry = self.done.get(name)
        path = self.path / name
        if entry is None or entry.get("sources") != sources:
            return False
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return False
        return sha256_file(path) == entry.get("sha256")

    def record(self, name: str, entry: dict[str, Any], sources: dict[str, str]) -> None:
        """`name` is finished and verified; `sources`: sha256 of every source file it was made from."""
        with self._lock:
            self.done[name] = {**entry, "sources": dict(sources)}
            self._save()

    def _save(self) -> None:
        path = self.root / STATE_NAME
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
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def discard_if_new(self) -> None:
        """Before any work was done (a refusal up front): remove a stage this run created, keep a resumable one."""
        if not self.resumed:
            shutil.rmtree(self.root, ignore_errors=True)

    def bytes_done(self) -> int:
        return sum(int(e.get("size", 0)) for e in self.done.values())

    def move_into_place(self) -> Path:
        """Replace OUT by the finished tree (an existing OUT was checked empty or --overwrite given)."""
        old = None
        if self.out.exists():
            old = self.out.with_name(f"{self.out.name}.replaced-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.path, self.out)
        shutil.rmtree(self.root, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


def announce(stage: Stage, log) -> None:
    """Say, on the run's log, whether the stage resumes an earlier run or threw one away, and why."""
    if stage.resumed:
        log(f"resuming {stage.root}: {len(stage.done)} file(s), {stage.bytes_done() / 1e9:.2f} GB already staged "
            f"and verified")
    elif stage.discarded:
        log(f"not resuming {stage.root}: {stage.discarded}")


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) else None
