"""Where a repack may write: every output name checked as a plain name under OUT, and OUT kept apart from
everything the source is made of.

Output names are built by trellis, but some parts come from the checkpoint (a source file's name, the TR3
shard a note in config.json names). `output_name` is the one check all of them pass before any work and
again where the file is opened for writing: relative, `/`-separated, every part a plain name (not empty, not
`.` or `..`), no backslash, drive letter, NUL or other control character. Anything else is refused by name.

`source_paths` lists what OUT must never overlap: the source directory and the real files its names lead to
(links included); for a Hub source also the repo's snapshot, the cache root and the Hub's home folders
(HF_HOME, HF_HUB_CACHE), since `--overwrite` deletes OUT and a stage is deleted and rebuilt.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header import plain_relative, safe_relative, text_escape
from trellis_cli.sources import Source


def output_name(name: Any, what: str) -> str:
    """`name` when it is a plain relative name under OUT; else a named refusal (`path.escape`, exit 1)."""
    if plain_relative(name):
        return name
    shown = text_escape(name) if isinstance(name, str) else f"{name!r} (a JSON {type(name).__name__})"
    raise CheckFailed(f"[path.escape] {what}: output name {shown} is not a plain file name under OUT (absolute, "
                      f"a `..` or empty part, a backslash or a control character); refusing before writing",
                      code="path.escape")


def output_path(tree: Path, name: Any, what: str = "output file") -> Path:
    """tree/name for a checked name (the same check as before the run, made again where the file is written)."""
    return tree / output_name(name, what)


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


def check_overlap(out: Path, stage: Path, protected: Iterable[Path], lock: Path | None = None) -> None:
    """Refuse an OUT (or its stage, OUT.partial) that equals, lies inside or contains a protected path, and a
    lock file (OUT.partial.lock) that would be one of them or lie inside one."""
    real_out, real_stage = out.resolve(), stage.resolve()
    for path in protected:
        src = Path(os.path.realpath(path))
        if lock is not None and Path(os.path.realpath(lock)).is_relative_to(src):
            raise UsageError(f"{lock}: the lock file of {out} would be written at or inside the source {src}; "
                             f"refusing to write into the source")
        if real_out == src or real_out.is_relative_to(src):
            raise UsageError(f"{out}: is inside the source {src} (the checkpoint, a file it is made of, or the Hub "
                             f"cache holding it); refusing to write into the source")
        if src.is_relative_to(real_out):
            raise UsageError(f"{out}: contains the source {src} (the checkpoint, a file it is made of, or the Hub "
                             f"cache holding it); refusing to replace it")
        if real_stage == src or src.is_relative_to(real_stage) or real_stage.is_relative_to(src):
            raise UsageError(f"{stage}: the staging directory of {out} overlaps the source {src}; refusing (it is "
                             f"deleted and rebuilt); choose another OUT or move the source")
