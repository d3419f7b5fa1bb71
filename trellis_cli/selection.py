"""Choosing part of a checkpoint: `--layers 3-5,40` ranges, and fetching only the files that hold them.

The caller maps layers to file names (it knows the checkpoint's index); this module parses the ranges and
downloads exactly the named files at the source's pinned commit, in parallel, reporting bytes as they arrive.
"""

from __future__ import annotations

import fnmatch
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from trellis_cli.errors import SourceUnavailable, UsageError
from trellis_cli.id_ranges import parse_range
from trellis_cli.sources import HubSource, LocalSource, Source

MAX_PARALLEL_DOWNLOADS = 4


# Far above any model's layer count or TP degree. Ranges are expanded to lists of ids, so they need a bound:
# `--layers 0-99999999999` is refused at once instead of filling memory.
MAX_ID = 1 << 16


def parse_layer_ranges(text: str, *, option: str = "--layers", limit: int = MAX_ID) -> list[int]:
    """"3-5,40" -> [3, 4, 5, 40] (sorted, no duplicates). Bad syntax, an empty text or an id at or above
    `limit` raises UsageError naming `option` and the part."""
    if not text.strip():
        raise UsageError(f"{option} is empty (expected ids or ranges, e.g. 3-5,40; omit it to select all)")
    layers: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise UsageError(f"{option} {text!r}: empty entry (expected e.g. 3-5,40)")
        try:
            lo, hi = parse_range(part)
        except ValueError as err:
            raise UsageError(f"{option} {text!r}: {err}") from None
        if hi >= limit:
            raise UsageError(f"{option} {text!r}: {hi} is out of range (ids must be below {limit})")
        layers.update(range(lo, hi + 1))
    return sorted(layers)


def require_count(value: object, option: str) -> None:
    """A count a library caller or an option gives (a TP degree, a context length): None, or an integer of at
    least 1 (not a bool, not a float): UsageError naming the option otherwise, never a ZeroDivisionError later."""
    if value is not None and (type(value) is not int or value < 1):
        raise UsageError(f"{option} must be an integer of at least 1, got {value!r}")


def require_present(chosen: list[int], available: Iterable[int], *, option: str = "--layers") -> list[int]:
    """`chosen` when every id is `available`; otherwise a UsageError naming the first missing ids and what
    the source has. One meaning in every command: a selection naming what is not there is a mistake, never
    a warning or a silent empty result."""
    have = sorted(available)
    present = set(have)
    missing = [i for i in chosen if i not in present]
    if missing:
        from trellis_cli.id_ranges import compact_ranges

        raise UsageError(f"{option}: {missing[:5]} not in the source (it has {compact_ranges(have) or 'none'})")
    return chosen


def select_files(available: Iterable[str], names_or_patterns: Iterable[str]) -> list[str]:
    """The available files matching exact names or fnmatch globs; an exact name that is missing is an error."""
    available = list(available)
    chosen: set[str] = set()
    for wanted in names_or_patterns:
        if any(ch in wanted for ch in "*?["):
            chosen.update(fnmatch.filter(available, wanted))
        elif wanted in available:
            chosen.add(wanted)
        else:
            raise SourceUnavailable(f"{wanted}: no such file in the checkpoint")
    return sorted(chosen)


def fetch_files(source: Source, names_or_patterns: Iterable[str],
                progress: Callable[[int], None] | None = None) -> Path:
    """Make the chosen files local and return the directory holding them (the cache snapshot for the Hub).

    Only matching files are downloaded, each pinned to the source's commit sha; files already cached cost
    nothing. `progress(n)` is called with bytes received (from worker threads, serialized here).
    """
    names = select_files(source.list_files(), names_or_patterns)
    if isinstance(source, LocalSource):
        for name in names:
            source.resolve(name)  # refuses paths leaving the directory
        return source.root
    if not isinstance(source, HubSource):
        raise TypeError(f"fetch_files: unsupported source {type(source).__name__}")
    report = _serialized(progress) if progress else None
    # Per-file hf_hub_download (rather than snapshot_download) because its tqdm_class reports each file's
    # bytes, which gives one honest progress bar; the cache layout and pinning are the same.
    with ThreadPoolExecutor(max_workers=MAX_PARALLEL_DOWNLOADS) as pool:
        paths = list(pool.map(lambda name: source.local_path(name, progress=report), names))
    return snapshot_root(source, paths, names)


def snapshot_root(source: HubSource, paths: list[Path], names: list[str]) -> Path:
    if paths:
        # Strip the file's own path components: <cache>/models--org--name/snapshots/<sha>/<name>
        return Path(paths[0]).parents[len(Path(names[0]).parts) - 1]
    from trellis_cli.hub_client import repo_cache_folder

    return repo_cache_folder(source.repo_id, source.cache_dir) / "snapshots" / source.revision


def _serialized(callback: Callable[[int], None]) -> Callable[[int], None]:
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            callback(n)

    return report


def parse_partition(text: str, tiers: int | None = 2, *, option: str = "--partition") -> tuple[int, ...]:
    """"192/64" -> (192, 64): experts per tier in ascending-K order; `tiers` counts are required (None: any
    number of at least two). The one reader of a partition, for synth and bench alike."""
    parts = [p.strip() for p in text.split("/")]
    if not all(p.isdigit() for p in parts) or len(parts) < 2:
        raise UsageError(f"{option} {text!r}: expected non-negative counts separated by '/', e.g. 192/64")
    counts = tuple(int(p) for p in parts)
    if tiers is not None and len(counts) != tiers:
        raise UsageError(f"{option} {text!r}: expected {tiers} non-negative counts separated by '/'")
    return counts


def parse_selection(text: str | list[int] | None, available: list[int], what: str) -> list[int]:
    """`--layers 3-5,40` (or the ids [3, 4, 5, 40], as options typed at the edge hold them) -> [3, 4, 5, 40];
    None selects everything; ids not available are refused."""
    if text is None or (isinstance(text, str) and text.strip() == ""):
        return sorted(available)
    have = set(available)
    if not isinstance(text, str):
        absent = sorted(i for i in set(text) if i not in have)
        if absent:
            raise UsageError(f"--{what}: {absent[:5]} not in the source (it has {_span(available)})")
        return sorted(set(text))
    chosen: set[int] = set()
    missing: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            first, last = parse_range(part)
        except ValueError as err:
            raise UsageError(f"--{what}: {err}") from None
        # Walk the available ids, never the range: 0-99999999999 must not be materialized.
        inside = {i for i in have if first <= i <= last}
        chosen |= inside
        if len(inside) < last - first + 1:
            missing += _first_missing(first, last, have, 5)
    if missing:
        raise UsageError(f"--{what}: {sorted(missing)[:5]} not in the source (it has {_span(available)})")
    return sorted(chosen)


def _first_missing(first: int, last: int, have: set[int], count: int) -> list[int]:
    """Up to `count` ids of [first, last] not in `have`; at most len(have) + count steps."""
    out: list[int] = []
    i = first
    while i <= last and len(out) < count:
        if i not in have:
            out.append(i)
        i += 1
    return out


def _span(ids: list[int]) -> str:
    return f"{min(ids)}-{max(ids)}" if ids else "none"
