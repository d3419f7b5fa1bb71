"""The one reader of a checkpoint's bytes: its listing and sizes, safetensors headers (parsed, or raw for a
quick count of names), the index and the JSON it declares, and the gate every command that trusts those bytes
passes.

Every command reads through here, so every command gets the same guards: a name that leaves the directory, a
dangling link or symlink loop, a FIFO or device (never opened), a file whose size changed since it was listed
(caught mid-rewrite), a header the bounded parser refuses. The opening (`dialects/open.py`) turns what this
module finds into findings, so validate can report every problem at once; `require_intact` is the fail-closed
side of the same facts, for the commands that answer a question about the bytes (fit, diff, inspect
--tensors): the first fault, named with its file and finding code, instead of an answer computed from the
files that could be read. `tests/base/test_one_reader.py` forbids reading a header anywhere else.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import warnings
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from itertools import count
from operator import attrgetter, itemgetter
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, NamedTuple, TypeVar

import numpy as np

from trellis_cli.checkpoint.columns import LinearColumns, all_distinct, linear_columns, no_expert_tensors
from trellis_cli.checkpoint.linear_names import NameLinears, name_linears
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.names import is_expert_name, parse_expert_name
from trellis_cli.checkpoint.tensor_map import files_named
from trellis_cli.errors import CheckFailed
from trellis_cli.findings import Finding, Location, Severity, error, warning
from trellis_cli.header import (HeaderError, JsonError, header_length, load_json, open_regular, os_reason, parse_header,
                                safe_relative)
from trellis_cli.header_layout import (HeaderColumns, canonical_columns, canonical_entries, digits_at,
                                       header_of_columns, layout, shared_offsets, uints, word_of)
from trellis_cli.header_records import MAX_HEADER_TENSORS, Header
from trellis_cli.integrity import CHECKSUM_MANIFEST
from trellis_cli.sources import Source

INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX = "model.safetensors.index.json"
# A production index maps ~935k tensors (about 80 MB of JSON), above the general JSON limit of sources.
MAX_INDEX_BYTES = 512 * 1024 * 1024
# Finding codes that say the bytes themselves cannot be trusted (as opposed to what they hold): a command
# that answers from the bytes refuses on any of them (`require_intact`).
BYTE_FAULT_PREFIXES = ("file.", "path.")
BYTE_FAULT_CODES = frozenset({"index.format", "index.file-missing", "exl3v1.layer-file-missing"})

_Read = TypeVar("_Read")


# ---- the listing -------------------------------------------------------------------------------------------

def listing(source: Source) -> dict[str, int]:
    """Every listed file with its size (-1: a dangling link or symlink loop)."""
    files: dict[str, int] = source.list_files()
    return files


def listing_findings(source: Source) -> Iterator[Finding]:
    """What a local listing left out: special files (never opened) and subdirectories it could not list."""
    for name, kind in source.special.items():
        # A FIFO or device where a shard, a JSON file or the manifest belongs means the checkpoint is broken.
        needed = name.endswith((".safetensors", ".json")) or name == CHECKSUM_MANIFEST
        make = error if needed else warning
        yield make("path.special", Location(file=name), "not a regular file: left out and never opened",
                   expected="a regular file", found=kind)
    for name, reason in source.unlistable.items():
        yield error("file.unreadable", Location(file=name), f"directory cannot be listed ({reason})")


def escapes(source: Source, name: str) -> bool:
    """True when `name` leaves the checkpoint (a path, or a link resolving outside it)."""
    return not safe_relative(name) or source.escapes(name)


# ---- headers -------------------------------------------------------------------------------------------------

def read_headers(source: Source, files: dict[str, int], progress: Callable[[str, int, int], None],
                 findings: list[Finding], linears: dict[str, NameLinears | None] | None = None,
                 taken: Callable[[str, Header, ShardNames], None] | None = None) -> dict[str, Header]:
    """Every safetensors header of the listing; each file that cannot be read is a finding instead.

    A remote source reads its headers concurrently first (one ranged request per file); errors resurface per
    file here. SourceUnavailable (network, auth) propagates: exit 3, not a finding. A local one's shards are read
    and split by a scan, in worker processes where that pays (`_header_columns`); `linears`, where given, takes
    each such header's `linear_names.name_linears`, split there too. `taken(name, header, names)`, where given, is
    called with each header read and its names for the index's proof (`ShardNames`), in the listing's order, as soon
    as it is built: what the caller does with it then runs while the workers read the next shards."""
    readable = []
    for name, size in files.items():
        if not name.endswith(".safetensors"):
            continue
        fault = _listed_fault(source, name, size)
        if fault is not None:
            findings.append(fault)
        else:
            readable.append(name)
    if readable:
        source.prefetch_headers(readable)
    headers: dict[str, Header] = {}
    progress("files", 0, len(readable))  # the total is the listing's: shown before the first header is read
    done = count(1)

    def read(name: str, scanned: _Scanned | None = None) -> bool:
        """One header into `headers`, or its refusal into `findings`: built from its columns where a scan gave them,
        else read (again) and parsed strictly, which words every refusal. Always True: the opening reads on."""
        names = None
        try:
            if scanned is None:
                headers[name] = _checked_header(source, name, files[name])
            else:
                columns, linears_found, names = scanned
                headers[name] = header_of_columns(name, columns, files[name])
                if linears is not None:
                    linears[name] = linears_found
        except CheckFailed as e:
            findings.append(_header_finding(name, e))
        else:
            if taken is not None:
                taken(name, headers[name], names or ShardNames.of(headers[name].tensors))
        progress("files", next(done), len(readable))
        return True

    with shared_offsets():  # shards laid out alike share their offsets' objects
        if source.root is None:  # a remote source: its headers were fetched above
            for name in readable:
                read(name)
        else:  # a local one: each shard's bytes read and split by a scan (forked where that pays)
            each_scanned(readable, partial(_header_columns, source, files), read, _OPENING_CHUNK)
    return headers


_Scanned = tuple[HeaderColumns, NameLinears | None, "ShardNames | None"]

_OPENING_CHUNK = 1  # a shard at a time to a worker for the opening: each result is ~1 MB at production size


def _scanned_names(columns: HeaderColumns) -> ShardNames | None:
    """A scanned header's names for the index's proof, joined as they came, where they are ASCII: a canonical
    header's names hold no quote, backslash or control byte, so then nothing JSON escapes (`ShardNames.plain`).
    Joined after the prefix they all share (`ShardNames.after_prefix`), in the worker: the next layer's shard of the
    same experts then has the same joined names, and the proof reorders them once (`_Order.picked`). None otherwise
    (the parsed names then)."""
    tensors = len(columns.kind_index)
    if not tensors or not columns.names.isascii():
        return None
    return ShardNames.after_prefix(columns.names.encode(), tensors)


def _header_columns(source: Source, files: dict[str, int], name: str) -> _Scanned | None:
    """A local shard's header as columns (`header_layout.canonical_columns`), with its names' linears
    (`linear_names.name_linears`), where it is read without a fault; None where the reader's checks refuse it or it
    is not in safetensors' own layout: it is then read again, as a remote one is, and parsed strictly (which words
    every refusal)."""
    try:
        columns = canonical_columns(raw_header(source, name, files[name]))
    except CheckFailed:
        return None
    if columns is None:
        return None
    return columns, name_linears(columns.names, len(columns.kind_index), '"'), _scanned_names(columns)


def _listed_fault(source: Source, name: str, size: int) -> Finding | None:
    if escapes(source, name):
        return error("path.escape", Location(file=name), "file resolves outside the checkpoint directory "
                     "(symlink or path)")
    if size < 0:
        return error("path.dangling", Location(file=name), "file is a dangling link (or a symlink loop)")
    return None


def _checked_header(source: Source, name: str, listed: int) -> Header:
    """One header, refused when the file's size is not the size it was listed with (a file rewritten while it
    is read: its header and its bytes may belong to two versions)."""
    header: Header = source.read_header(name)
    if header.file_size is not None and listed >= 0 and header.file_size != listed:
        raise CheckFailed(f"{name}: the file changed while it was read (listed with {listed} bytes, {header.file_size} "
                          f"bytes when its header was read); read it again once it is complete", code="file.changed")
    return header


def _header_finding(name: str, e: CheckFailed) -> Finding:
    """The source's refusal of a header as a finding, under the code the source gave it (HeaderError's own,
    or file.unreadable); the message without the file name, which the location carries."""
    message = str(e)
    detail = message[len(name) + 2:] if message.startswith(name + ": ") else message
    return error(e.code or "file.header", Location(file=name), detail)


def shard_header(ckpt: Checkpoint, name: str) -> Header:
    """The header of one listed file, from the opening when it read it, else read now under the same guards.
    CheckFailed names the file and the finding code."""
    found = ckpt.headers.get(name)
    if found is not None:
        return found
    if name not in ckpt.files:
        raise CheckFailed(f"{name}: not in the checkpoint's listing", code="file.missing")
    fault = _listed_fault(ckpt.source, name, ckpt.files[name])
    if fault is not None:
        raise CheckFailed(f"{name}: {fault.message}", code=fault.code)
    return _checked_header(ckpt.source, name, ckpt.files[name])


def source_header(source: Source, name: str) -> Header:
    """One header of a source read without opening it as a checkpoint (a route pack's carried shards), under
    the same guards as `shard_header`."""
    files = listing(source)
    if name not in files:
        raise CheckFailed(f"{name}: not in the listing of {source.description}",
                          code="file.missing")
    fault = _listed_fault(source, name, files[name])
    if fault is not None:
        raise CheckFailed(f"{name}: {fault.message}", code=fault.code)
    return _checked_header(source, name, files[name])


def raw_header(source: Source, name: str, listed: int) -> bytes:
    """The unparsed header bytes of a local file (length prefix checked), for a quick look that only counts
    names; CheckFailed (with its finding code) for everything `read_headers` would refuse before parsing."""
    fault = _listed_fault(source, name, listed)
    if fault is not None:
        raise CheckFailed(f"{name}: {fault.message}", code=fault.code)
    try:
        with open_regular(source.local_path(name)) as f:
            size = os.fstat(f.fileno()).st_size
            n = header_length(f.read(8), name, size)
            data = f.read(n)
    except HeaderError as e:
        raise CheckFailed(str(e), code=e.code) from e
    except OSError as e:
        raise CheckFailed(f"{name}: cannot read the file ({os_reason(e)})", code="file.unreadable") from e
    if len(data) != n:
        raise CheckFailed(f"{name}: header truncated: expected {n} bytes, read {len(data)}", code="file.header")
    if size != listed:
        raise CheckFailed(f"{name}: the file changed while it was read", code="file.changed")
    return data


# ---- scans of many local shards ----------------------------------------------------------------------------

# fit, the dry run and the full opening scan every raw header of a local checkpoint: at production size (~76 shards,
# ~935k tensors) one to two seconds of regex work in one process, on hosts of 16-128 cores. Fewer shards than PARALLEL_SHARDS are
# scanned in this process (starting workers would cost more than it saves); more by up to MAX_SCAN_WORKERS.
PARALLEL_SHARDS = 8
MAX_SCAN_WORKERS = 8
_worker_scan: Callable[[str], Any] | None = None  # a forked worker's scan (`_start_worker`)


def scan_shards(names: list[str], scan: Callable[[str], _Read | None], progress: Callable[[int], None],
                taken: Callable[[str, _Read], None] | None = None) -> list[_Read] | None:
    """`scan(name)` of each local shard of `names`, in that order; None at the first scan that gives None (the
    shards after it count for nothing, as a loop would never have read them). `scan` reads its shard itself and
    gives None for every refusal it expects; `taken(name, result)`, where given, then `progress(done)` are called
    after each shard, in order, here (while the workers scan the next ones). Forked where that pays
    (`each_scanned`)."""
    found: list[_Read] = []

    def take(name: str, result: _Read | None) -> bool:
        if result is None:
            return False
        found.append(result)
        if taken is not None:
            taken(name, result)
        progress(len(found))
        return True

    return found if each_scanned(names, scan, take) else None


def each_scanned(names: list[str], scan: Callable[[str], _Read], take: Callable[[str, _Read], bool],
                 chunk: int = sys.maxsize) -> bool:
    """`take(name, scan(name))` of each local shard of `names`, in that order, here, up to the first that gives False
    (then False). `scan` reads its shard itself; an exception it raises is raised here. A worker is given about a
    quarter of its share of the shards at a time, at most `chunk` (all of a chunk's results are held here, pickled,
    then unpickled, while the first of them is taken: large results want short chunks).

    Where a fork is safe and pays (`_scan_workers`), forked processes read and scan the shards (`scan` is inherited,
    never pickled) and send back only each shard's result; none outlives this call. Where no process can be had,
    or one is lost (killed), the shards not yet taken are scanned here."""
    taken = [0]

    def counted(name: str, result: _Read) -> bool:
        if not take(name, result):
            return False
        taken[0] += 1
        return True

    workers = _scan_workers(len(names))
    if workers > 1:
        try:
            return _scan_forked(names, scan, workers, counted, min(chunk, len(names) // (4 * workers)))
        except (OSError, BrokenProcessPool):
            pass
    rest = names[taken[0]:]
    return all(map(counted, rest, map(scan, rest)))


def _scan_forked(names: list[str], scan: Callable[[str], _Read], workers: int, take: Callable[[str, _Read], bool],
                 chunk: int) -> bool:
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork"), initializer=_start_worker,
                               initargs=(scan,))
    chunks = [names[at:at + max(1, chunk)] for at in range(0, len(names), max(1, chunk))]
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns at a fork of any other thread, native ones included (a BLAS's pool, which
            # handles a fork itself); no other Python thread runs here (`_scan_workers`), and a worker runs only
            # `scan`. The first submit forks every worker, before the pool starts its own thread.
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            # Ctrl-C held back while they are forked (then delivered here): a worker ignores it from its start
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                pending = deque([pool.submit(_run_scans, chunks[0])])
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        # At most two chunks a worker in flight: results the workers finish ahead of `take` wait here, unpickled
        # (~1.5 MB a production shard for the opening), so a slower `take` must not let all of them pile up.
        ahead = iter(chunks[1:])
        for part in ahead:
            pending.append(pool.submit(_run_scans, part))
            if len(pending) >= 2 * workers:
                break
        for part in chunks:
            results = pending.popleft().result()
            following = next(ahead, None)
            if following is not None:
                pending.append(pool.submit(_run_scans, following))
            if not all(map(take, part, results)):
                return False
        return True
    finally:
        pool.shutdown(cancel_futures=True)  # (waits for the workers to exit; after a False, for the chunks begun)


def _scan_workers(shards: int) -> int:
    """How many processes scan `shards` local shards: this one alone unless there are PARALLEL_SHARDS or more, more
    than one core is usable (its affinity, where the platform has one) and a fork is available and safe: POSIX but
    not macOS (whose system libraries are not fork-safe), no other Python thread (a fork copies only the calling
    thread: a lock another one holds would never be released in the child), and not itself a daemonic worker (which
    may not start processes)."""
    if shards < PARALLEL_SHARDS or sys.platform == "darwin" or "fork" not in multiprocessing.get_all_start_methods() \
            or threading.active_count() != 1 or multiprocessing.current_process().daemon:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_SCAN_WORKERS, shards)


def _start_worker(scan: Callable[[str], Any]) -> None:
    """A forked worker writes nothing (its standard streams go nowhere) and leaves Ctrl-C to the parent, which then
    shuts the pool down."""
    global _worker_scan
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    sys.stdout = sys.stderr = open(os.devnull, "w")
    _worker_scan = scan


def _run_scans(names: list[str]) -> list[Any]:
    assert _worker_scan is not None
    return list(map(_worker_scan, names))


class ShardColumns(NamedTuple):
    """Every shard of a checkpoint as `fit` reads it without the per-tensor model: the rank-sliced linears of
    each shard of experts as columns (`columns.linear_columns`), and the parsed headers of the shards that hold
    no routed-expert tensor, in the listing's order."""

    linears: dict[str, LinearColumns]
    others: dict[str, Header]

    def names(self) -> dict[str, ShardNames] | None:
        """Every shard's names in header order, for the index's rebuilt proof (`index_files`), where no name can
        be in two shards: each shard of experts a MoE layer of its own (every name of it names that layer), and
        the other shards' names distinct, none naming a routed expert. None otherwise."""
        layers = [found.layer for found in self.linears.values()]
        others = [name for header in self.others.values() for name in header.tensors]
        if len(set(layers)) != len(layers) or len(set(others)) != len(others) or \
                any(".mlp.experts." in name for name in others):
            return None
        names = {file: _shard_names_of(found) for file, found in self.linears.items()}
        names.update(shard_names(self.others))
        return names


def _shard_names_of(found: LinearColumns | Header) -> ShardNames:
    """The names of one shard as `shard_columns` reads it, in its header's order."""
    return ShardNames.joined(found.names, found.tensors, found.prefix) if isinstance(found, LinearColumns) else \
        ShardNames.of(found.tensors)


def shard_columns(source: Source, files: dict[str, int], progress: Callable[[str, int, int], None],
                  proof: IndexProof | None = None) -> ShardColumns | None:
    """`ShardColumns` of a local checkpoint, under the guards of `read_headers`; None where any shard is not one
    of the two kinds, or anything the full opening would report about a shard (the caller then opens it in
    full, which names it). The shards are read and scanned in worker processes where that pays (`scan_shards`);
    `proof`, where given, takes each shard's names as it arrives (`IndexProof.take`)."""
    names = sorted(name for name in files if name.endswith(".safetensors"))
    progress("files", 0, len(names))

    def taken(name: str, shard: Any) -> None:  # (a LinearColumns or a Header)
        if proof is not None:
            proof.take(name, _shard_names_of(shard))

    found = scan_shards(names, partial(_columns_of, source, files), lambda done: progress("files", done, len(names)),
                        taken)
    if found is None:
        return None
    return ShardColumns({name: f for name, f in zip(names, found) if isinstance(f, LinearColumns)},
                        {name: f for name, f in zip(names, found) if isinstance(f, Header)})


def _columns_of(source: Source, files: dict[str, int], name: str) -> LinearColumns | Header | None:
    """One shard as `shard_columns` reads it: its linears as columns, or its parsed header where it names no routed
    expert; None where it is neither, or the full opening would report anything about it."""
    try:
        raw = raw_header(source, name, files[name])
        if not no_expert_tensors(raw):
            return linear_columns(raw, files[name])
        header = parse_header(name, raw, len(raw), files[name])
    except (CheckFailed, HeaderError):
        return None
    if header.data_start + header.data_end > files[name]:
        return None  # tensors past the end of the file (`byte_faults` words it)
    return header


def same_bytes(a: Source, a_files: dict[str, int], b: Source) -> dict[str, int] | None:
    """B's listing, where everything an opening reads of two local checkpoints is byte for byte the same: the
    same names and sizes listed, no special file, unlistable directory or name leaving either directory, the same
    header bytes in every safetensors file and the same bytes in every other file. Opening B would then build
    A's model again (diff's other side is usually a copy). None otherwise, or when a file cannot be read."""
    if a.root is None or b.root is None or a.special or a.unlistable:
        return None
    b_files = listing(b)
    if b.special or b.unlistable or b_files != a_files or any(size < 0 for size in a_files.values()):
        return None
    try:
        for name, size in a_files.items():
            if escapes(a, name) or escapes(b, name):
                return None
            if name.endswith(".safetensors"):
                if raw_header(a, name, size) != raw_header(b, name, size):
                    return None
            elif size > MAX_INDEX_BYTES or not _same_file(a, b, name):
                return None
    except (CheckFailed, OSError):
        return None
    return b_files


def _same_file(a: Source, b: Source, name: str) -> bool:
    """Whether one file holds the same bytes in both sources, compared piece by piece (an index is ~80 MB)."""
    with open_regular(a.local_path(name)) as fa, open_regular(b.local_path(name)) as fb:
        read = 0
        while read <= MAX_INDEX_BYTES:
            piece = fa.read(_INDEX_PIECE)
            if piece != fb.read(_INDEX_PIECE):
                return False
            if not piece:
                return True
            read += len(piece)
    return False  # grown past the limit since it was listed


class HeaderNames(NamedTuple):
    """What a quick look needs of one header: the MoE layers of its routed-expert tensors, how many of its
    tensors are routed experts and how many there are, and (only when it holds both kinds) its other tensors
    as (name, dtype, shape) in stored order, with its metadata."""

    layers: set[int]
    experts: int
    tensors: int
    others: list[tuple[str, str, tuple[int, ...]]] | None
    metadata: dict[str, str] | None
    trellis: "CodeCounts"  # how many routed-expert I16 `trellis` tensors have a shape


def header_names(source: Source, name: str, listed: int) -> HeaderNames:
    """The names of one local header, as the full parser would read them, without building an entry per tensor
    where the bytes prove it unnecessary: a header in safetensors' own layout (`canonical_header`) is counted in
    its bytes (every name a key that needs no decoding; in bulk, `counted_in_bulk`, where that reading proves it);
    any other is parsed in full. CheckFailed (with its finding code) for everything the full opening refuses."""
    raw = raw_header(source, name, listed)
    counted = counted_in_bulk(raw)
    entries = canonical_entries(raw) if counted is None else raw
    if entries is not None:
        if counted is None:
            layers = _expert_layers(entries)
            experts = sum(entries.count(b'"model.layers.%d.mlp.experts.' % layer) for layer in layers)
            counted = (layers, experts, raw.count(b'"data_offsets"'), CodeCounts.in_entries(entries))
        layers, experts, tensors, codes = counted
        others, metadata = None, None
        if experts and experts != tensors:  # a few shards mix both: their other tensors, decoded
            doc = json.loads(raw)
            metadata = doc.pop("__metadata__", None) or {}
            stored = sorted(((n, e) for n, e in doc.items() if not is_expert_name(n)),
                            key=lambda item: item[1]["data_offsets"][0])
            others = [(n, e["dtype"], tuple(e["shape"])) for n, e in stored]
        return HeaderNames(layers, experts, tensors, others, metadata, codes)
    try:
        header = parse_header(name, raw, len(raw), listed)
    except HeaderError as e:
        raise CheckFailed(str(e), code=e.code) from e
    layers, experts, trellis = set(), 0, Counter[tuple[int, ...]]()
    for tensor in header.tensors.values():
        parsed = parse_expert_name(tensor.name)
        if parsed is not None:
            layers.add(parsed.layer)
            experts += 1
            if _TRELLIS_NAME.search(tensor.name) and tensor.dtype == "I16" and len(tensor.shape) == 3:
                trellis[tensor.shape] += 1
    if experts and experts != len(header.tensors):
        kept = sorted((t for t in header.tensors.values() if not is_expert_name(t.name)), key=lambda t: t.begin)
        return HeaderNames(layers, experts, len(header.tensors), [(t.name, t.dtype, t.shape) for t in kept],
                           dict(header.metadata), CodeCounts(dict(trellis), trellis.total()))
    return HeaderNames(layers, experts, len(header.tensors), None, None, CodeCounts(dict(trellis), trellis.total()))


def every_header_names(source: Source, files: dict[str, int]) -> dict[str, HeaderNames] | None:
    """`header_names` of every local safetensors file in sorted order, in worker processes where that pays
    (`scan_shards`); None at the first one it refuses (the full opening names it)."""
    names = sorted(name for name in files if name.endswith(".safetensors"))
    found = scan_shards(names, partial(_names_of, source, files), lambda _done: None)
    return None if found is None else dict(zip(names, found))


def _names_of(source: Source, files: dict[str, int], name: str) -> HeaderNames | None:
    try:
        return header_names(source, name, files[name])
    except CheckFailed:
        return None


class CodeCounts(NamedTuple):
    """How many routed-expert `trellis` tensors (I16) of one header have a given shape, and how many `trellis`
    tensors it holds: counted in the bytes of a canonical header's entries (`in_entries`; any `.trellis` key counts
    in the total, so a stray one defers rather than passes), or from the parsed entries. Plain counts: a shard
    scanned in a worker process sends back these, not its entries."""

    counts: dict[tuple[int, ...], int]
    total: int

    @classmethod
    def in_entries(cls, entries: bytes) -> "CodeCounts":
        # One pass over the entries: in that layout every shape is written canonically (header.DIM_PATTERN), so
        # its text and its tuple of integers name each other.
        found = Counter(_TRELLIS_SHAPE.findall(entries))
        counts = {tuple(map(int, text.split(b","))) if text else (): n for text, n in found.items()}
        return cls(counts, entries.count(b'.trellis":{'))

    def of(self, shape: tuple[int, ...]) -> int:
        return self.counts.get(shape, 0)


_DATA_OFFSETS = word_of(b"data_off"), word_of(b"_offsets")
_I16 = word_of(b"I16")


def counted_in_bulk(raw: bytes) -> tuple[set[int], int, int, CodeCounts] | None:
    """`header_names`' counts of a canonical header (its MoE layers, routed-expert and all tensors, trellis
    shapes) read from its proven layout (`header_layout.layout`) without a regex: each name's
    `model.layers.L.mlp.experts.` prefix compared as words, its layer read at its first dot after `layers.`.
    None where it cannot be read so (the regexes then count)."""
    found = layout(raw)
    if found is None:
        return None
    quotes, words = found.quotes, found.words
    opens, closes = quotes[:, 0], quotes[:, 1]
    named = (closes - opens == 13) & (words.at(opens + 1) == _DATA_OFFSETS[0]) & \
        (words.at(opens + 5) == _DATA_OFFSETS[1])
    tensors = len(quotes) + raw.count(b'"data_offsets"', 0, found.head) + int(named.sum())
    if tensors > MAX_HEADER_TENSORS:
        return None
    prefixed = (words.at(opens) == word_of(b'"model.l')) & (words.at(opens + 6) == word_of(b".layers."))
    digits = digits_at(words, opens + 14)
    if bool((prefixed & (digits == 8)).any()):
        return None  # a layer of eight digits or more: the regex reads it
    dot = opens + 14 + digits
    expert = prefixed & (digits > 0) & (words.at(dot) == word_of(b".mlp.exp")) & \
        (words.at(dot + 5) == word_of(b"experts."))
    layer = uints(words, found.data, opens + 14, dot, 7, expert)
    if layer is None:
        return None  # a layer written with a leading zero: the regex decides
    trellis = words.at(np.maximum(closes - 8, 0)) == word_of(b".trellis")
    shaped = trellis & (found.dtype == _I16)
    ndim, dims = found.ndim[shaped], found.dims[shaped]
    key = ((ndim * 100_000 + dims[:, 0]) * 100_000 + dims[:, 1]) * 100_000 + dims[:, 2]
    keys, first, count = np.unique(key, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")  # in order of first use, as the regex's Counter
    counts = {tuple(dims[i, :ndim[i]].tolist()): int(c) for i, c in zip(first[order].tolist(), count[order])}
    return (set(layer[expert].tolist()), int(expert.sum()), tensors, CodeCounts(counts, int(trellis.sum())))


def _expert_layers(entries: bytes) -> set[int]:
    """The MoE layers whose routed-expert keys a canonical header's entries hold: one search per layer found
    (a shard usually holds one), never a match per key."""
    layers: set[int] = set()
    while True:
        skip = "|".join(f"{layer}\\." for layer in sorted(layers))
        pattern = _EXPERT_LAYER if not layers else re.compile(
            rb'"model\.layers\.(?!(?:' + skip.encode() + rb'))(0|[1-9][0-9]*)\.mlp\.experts\.')
        found = pattern.search(entries)
        if found is None:
            return layers
        layers.add(int(found.group(1)))


_TRELLIS_NAME = re.compile(r'experts\.(?:0|[1-9][0-9]*)\.(?:gate|up|down)_proj\.(?:rank(?:0|[1-9][0-9]*)\.)?trellis$')
_EXPERT_LAYER = re.compile(rb'"model\.layers\.(0|[1-9][0-9]*)\.mlp\.experts\.')
_TRELLIS_SHAPE = re.compile(rb'\.trellis":\{"dtype":"I16","shape":\[([0-9,]*)\]')


# ---- the index -----------------------------------------------------------------------------------------------

def index_name(files: dict[str, int]) -> str | None:
    names = [n for n in files if n.endswith(INDEX_SUFFIX)]
    if not names:
        return None
    return DEFAULT_INDEX if DEFAULT_INDEX in names else names[0]


def read_index(source: Source, files: dict[str, int], findings: list[Finding]) -> tuple[str, dict[str, str],
                                                                                       dict[str, Any]] | None:
    """(index file, weight_map, metadata) of the checkpoint's index, or None (absent, or a finding)."""
    name = index_name(files)
    if name is None:
        return None
    data = _read_index_json(source, files, name, findings)
    if data is None:
        return None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        findings.append(error("index.format", Location(file=name),
                              "index has no weight_map object of tensor -> file strings"))
        return None
    metadata = data.get("metadata")
    return name, weight_map, metadata if isinstance(metadata, dict) else {}


def index_files(source: Source, files: dict[str, int], names: Mapping[str, "ShardNames"] | None = None,
                proof: IndexProof | None = None) -> set[str] | None:
    """The files a large local index names, where its bytes prove that `read_index` reads it without a finding:
    ASCII, `{"metadata": {...}, "weight_map": {"name": "file", ...}}` (whitespace between tokens allowed, no
    escape), no name twice. An empty set without an index; None for anything else (a small index included, which
    `read_index` reads at once): the caller then reads it in full, which words every finding. With `names` (each
    shard's names in header order, no name in two shards) an index written as writers write one is proven by
    writing it again (`_rebuilt_index`: then it names exactly the shards that hold a tensor); any other by the
    streamed proof, in one regex pass, without the ~935k-key dict a production index decodes into. `proof`: the
    rebuilt proof made as the shards were read, where one was (`IndexProof`)."""
    if index_name(files) is None:
        return set()
    if names is not None and ((proof is not None and proof.proven(names) is not None) or
                              _rebuilt_index(source, files, names) is not None):
        return {file for file, shard in names.items() if shard.tensors}
    proven = _proven_index(source, files, lambda _names, _files: True)
    return None if proven is None else proven[2]


class ShardNames(NamedTuple):
    """Every tensor name of one shard in its header's order, for the rebuilt proof of the index: a parsed header's
    names as they are, or a raw header's joined by `"` (`joined`: one string per shard rather than one per name,
    ~935k at production size: a canonical header's names as the opening's scan joined them, or canonical linear
    names after their layer's `prefix` as `columns.linear_columns` reads them). Joined names hold nothing JSON
    escapes (`plain`), so their entries' text is proven plain from its separators alone."""

    tensors: int
    names: Collection[str] | bytes  # (a header's dict of tensors: its keys, listed only where an order needs it)
    plain: bool = False  # every name ASCII with nothing JSON escapes (no quote, backslash or control byte)
    prefix: bytes = b""  # what every name of joined `names` starts with, left out of them

    @classmethod
    def of(cls, names: Collection[str]) -> "ShardNames":
        return cls(len(names), names)

    @classmethod
    def joined(cls, joined: bytes, tensors: int, prefix: bytes) -> "ShardNames":
        """`tensors` plain names (ASCII, nothing JSON escapes), each `prefix` and a part of `joined` (the parts joined
        by `"`, counted by the reader that joined them)."""
        return cls(tensors, joined, True, prefix)

    @classmethod
    def after_prefix(cls, joined: bytes, tensors: int) -> "ShardNames":
        """`joined` (`tensors` plain names joined by `"`) as `joined` names after the longest prefix that its first
        and last name share, where every name starts with it (no quote is in a plain name: each quote of the join
        is then followed by it); else as they are."""
        first, last = joined[:joined.find(b'"')] if tensors > 1 else joined, joined[joined.rfind(b'"') + 1:]
        prefix = os.path.commonprefix([first, last])
        if not prefix or joined.count(b'"' + prefix) != tensors - 1:
            return cls.joined(joined, tensors, b"")
        return cls.joined(joined.replace(b'"' + prefix, b'"')[len(prefix):], tensors, prefix)

    def joined_by(self, order: _Order | None, after: bytes) -> tuple[bytes, bytes]:
        """The shard's entries but their first quote and what ends the last, in two pieces (head, the rest): its
        names in `order` (None, or one of another shard's length: as listed), joined by `after`."""
        names = self.names
        in_order = order is not None and len(order.positions) == self.tensors
        if isinstance(names, bytes):
            between = after + self.prefix
            if order is None or not in_order:
                return self.prefix, names.replace(b'"', between)  # (each quote of the join is between two names)
            return self.prefix, between.join(order.picked(names))
        ordered = map(list(names).__getitem__, order.positions) if order is not None and in_order else names
        return b"", after.decode().join(ordered).encode()

    def order_of(self, keys: list[bytes]) -> _Order | None:
        """The positions in the shard's names of `keys` (plain names, as written), each once; None otherwise."""
        if len(keys) != self.tensors:
            return None
        names = self.names
        if isinstance(names, bytes):
            position: dict[Any, int] = dict(zip(map(self.prefix.__add__, names.split(b'"')), range(self.tensors)))
            found: list[Any] = keys
        else:
            position = dict(zip(names, range(self.tensors)))
            found = b'"'.join(keys).decode().split('"')  # ASCII without escapes: the names as JSON decodes them
        try:
            order = list(map(position.__getitem__, found))
        except KeyError:
            return None
        return _Order(order) if len(set(order)) == len(order) else None

    def listed(self) -> Collection[str]:
        if isinstance(self.names, bytes):
            return [self.prefix.decode() + name for name in self.names.decode().split('"')]
        return self.names


class _Order:
    """Positions in a shard's names in the order a writer wrote them (learned from one shard, tried on the next),
    with the joined names they picked last: the next shard of the same names after its prefix (another layer of
    the same experts) picks none again."""

    def __init__(self, positions: list[int]) -> None:
        self.positions = positions
        self._names: bytes | None = None
        self._picked: Collection[bytes] = ()

    def picked(self, names: bytes) -> Collection[bytes]:
        """The parts of `names` (joined by `"`) at the positions (picked in C: a production shard's ~12k names)."""
        if names != self._names:
            items = names.split(b'"')
            self._picked = itemgetter(*self.positions)(items) if len(self.positions) > 1 else \
                [items[at] for at in self.positions]
            self._names = names
        return self._picked


def shard_names(headers: Mapping[str, Header]) -> dict[str, ShardNames]:
    """The names of every parsed header that holds a tensor, in its order, for `_rebuilt_index`."""
    return {file: ShardNames.of(header.tensors) for file, header in headers.items() if header.tensors}


def index_of(source: Source, files: dict[str, int], tensors: Mapping[str, Any], headers: Mapping[str, Header],
             proof: IndexProof | None = None) -> tuple[str, dict[str, Any]] | None:
    """(index file, its metadata) where a large local index is proven in its bytes (as `index_files` proves it)
    to map exactly the names of `tensors` (name -> TensorRef), each to the file holding it: what `read_index`
    would decode, compared with the headers, without the ~935k fresh strings of that decode (~400 MB and three
    seconds at production size). An index written as writers write one is proven by writing it again from
    `headers` (file -> its parsed header, whose tensors `tensors` merges: `_rebuilt_index`); any other by the
    streamed proof. None otherwise: the caller reads it in full. `proof`: the rebuilt proof made as the headers were
    read, where one was (`IndexProof`: `read_headers`' `taken`)."""
    if tensors and sum(len(header.tensors) for header in headers.values()) == len(tensors):
        # (a name in several shards would be written twice)
        names = shard_names(headers)
        rebuilt = proof.proven(names) if proof is not None else None
        if rebuilt is None:
            rebuilt = _rebuilt_index(source, files, names)
        if rebuilt is not None:
            return rebuilt
    seen = [0]

    def agrees(names: list[bytes], named: list[bytes]) -> bool:
        keys = b'"'.join(names).decode().split('"')  # ASCII without escapes: the names as JSON decodes them
        try:
            held = list(map(_FILE_OF, map(tensors.__getitem__, keys)))
        except KeyError:
            return False
        seen[0] += len(keys)
        return held == b'"'.join(named).decode().split('"')

    proven = _proven_index(source, files, agrees)
    if proven is None or seen[0] != len(tensors):
        return None  # (no name twice, so as many names as tensors is every tensor once)
    return proven[0], proven[1]


def _proven_index(source: Source, files: dict[str, int], piece: Callable[[list[bytes], list[bytes]], bool]
                  ) -> tuple[str, dict[str, Any], set[str]] | None:
    """(index file, metadata, the files it names) of a large local index proven in its bytes, each piece of its
    entries (names, files) also accepted by `piece`; None where anything is not proven."""
    found = _read_large_index(source, files, lambda f: _proven_stream(f, piece))
    return None if found is None else (found[0], *found[1])


def _read_large_index(source: Source, files: dict[str, int], read: Callable[[Any], _Read | None]
                      ) -> tuple[str, _Read] | None:
    """(index file, what `read` finds in it, open) for a local index above the general JSON limit and within
    MAX_INDEX_BYTES, the one kind its bytes are proven in; None without one, where it cannot be opened or read,
    or where `read` finds nothing (the full reader then decides, and words every finding)."""
    name = _large_index(source, files)
    if name is None:
        return None
    try:
        with open_regular(source.local_path(name)) as f:
            found = read(f)
    except _UNREAD:
        return None
    return None if found is None else (name, found)


def _large_index(source: Source, files: dict[str, int]) -> str | None:
    """The index file of a local checkpoint where it is one whose bytes are proven (`_read_large_index`)."""
    name = index_name(files)
    if name is None or source.root is None:
        return None
    from trellis_cli.sources import MAX_JSON_BYTES

    return name if MAX_JSON_BYTES < files.get(name, 0) <= MAX_INDEX_BYTES else None


_UNREAD = (OSError, CheckFailed, UnicodeError)  # an index that cannot be opened or read as plain bytes: not proven


def _proven_stream(f: Any, piece: Callable[[list[bytes], list[bytes]], bool]) -> tuple[dict[str, Any], set[str]] | None:
    """`_proven_index` of an open index file, read in pieces of `_INDEX_PIECE` bytes: at most about two pieces and
    one piece's strings are held at a time (a production index is ~80 MB)."""
    head = _index_head(f)
    if head is None:
        return None
    metadata, read = head
    f.seek(read)
    buffer = b""
    spaces = spaces_read = 0
    named: set[bytes] = set()
    hashes: list[np.ndarray] = []
    # Without a backslash every `"` delimits a string: from the first name on, the pieces between are name, `:`,
    # file, `,` (the last one the closing braces). Taken in pieces of whole entries, each cut where a name opens.
    last = False
    while not last:
        more = f.read(_INDEX_PIECE)
        read += len(more)
        if read > MAX_INDEX_BYTES or not _plain(more):
            return None  # (grown past the limit since it was listed: the full reader words it)
        spaces_read += _spaces(more)
        buffer += more
        last = not more
        cut = len(buffer) if last else _last_entry_start(buffer)
        if not cut:
            continue  # not one whole entry yet
        tokens = buffer[:cut].split(b'"')
        buffer = buffer[cut:]
        if tokens[0] or len(tokens) < 5 or (len(tokens) - 1) % 4:
            return None
        keys, colons, values, gaps = tokens[1::4], tokens[2::4], tokens[3::4], tokens[4::4]
        ends = [(gaps[:-1], _INDEX_COMMA), (gaps[-1:], _INDEX_TAIL if last else _INDEX_COMMA)]
        if not all(_INDEX_COLON.fullmatch(gap) for gap in set(colons)) or \
                not all(pattern.fullmatch(gap) for part, pattern in ends for gap in set(part)):
            return None
        for part in (colons, gaps):
            spaces += sum(part.count(gap) * _spaces(gap) for gap in set(part))
        if not piece(keys, values):
            return None
        named.update(values)
        hashes.append(np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)))
    if spaces != spaces_read:
        return None  # a line break or tab inside a string
    if not all_distinct(np.concatenate(hashes)):
        return None  # a name twice (or two names of one hash): the full reader decides
    return metadata, {file.decode() for file in named}


def _index_head(f: Any) -> tuple[dict[str, Any], int] | None:
    """The metadata of an open index file and where its first entry starts, where its head is
    `{"metadata": {...}, "weight_map": {` (or without the metadata) in plain bytes: ASCII, no escape."""
    buffer = b""
    while True:  # read until it is whole (its last whitespace may run on into the next piece)
        more = f.read(_INDEX_PIECE)
        if not _plain(more):
            return None
        buffer += more
        head = _INDEX_HEAD.match(buffer)
        if head is not None and head.end() < len(buffer):
            break
        if not more or len(buffer) > _INDEX_HEAD_BYTES:
            return None  # no entry after it, or metadata of a size no writer gives: the full reader decides
    metadata: Any = {}
    if head.group(1) is not None:  # the metadata: an object of plain values, no key twice
        try:
            metadata = load_json(head.group(1))
        except JsonError:
            return None
        if not isinstance(metadata, dict):
            return None
    return metadata, head.end()


def _rebuilt_index(source: Source, files: dict[str, int], names: Mapping[str, ShardNames]
                   ) -> tuple[str, dict[str, Any]] | None:
    """(index file, its metadata) of a large local index written as writers write one, with the separators of its
    first entry: shard after shard, `"name": "file"` for every name of its shard (`names`: file -> its names in
    header order, no name in two files) in one order of them (`_by_shard`), or every name sorted (`_by_name`, as
    `json.dumps(sort_keys=True)` writes it).

    Why it is a proof: those entries are written again from the headers' names (C joins of names that JSON writes
    without an escape: ASCII, no quote, backslash or control character) and compared byte for byte with the
    file's; bytes equal to that text decode to exactly {name: its shard} for every tensor, each once, which is what
    `read_index` would decode and the opening compare. None wherever a byte differs (an index written otherwise,
    or one that disagrees): the streamed proof decides."""
    if not any(shard.tensors for shard in names.values()):
        return None
    return _read_large_index(source, files, lambda f: _rebuilt_stream(f, names))


def _rebuilt_stream(f: Any, names: Mapping[str, ShardNames]) -> dict[str, Any] | None:
    """`_rebuilt_index` of an open index file: its metadata where its bytes are the rebuilt text, else None."""
    head = _rebuilt_head(f)
    if head is None:
        return None
    metadata, start, gaps, first = head
    end = _by_shard(f, start, names, gaps)
    if end is None and first.decode() == min(min(shard.listed()) for shard in names.values() if shard.tensors):
        end = _by_name(f, start, names, gaps)
    return metadata if end is not None and _rebuilt_tail(f, end) else None


def _rebuilt_head(f: Any) -> tuple[dict[str, Any], int, _Gaps, bytes] | None:
    """(metadata, where the first entry starts, the separators of that entry, its name) of an open index file whose
    head is plain (`_index_head`) and whose first entry has a colon and a comma; None otherwise."""
    head = _index_head(f)
    if head is None:
        return None
    metadata, start = head
    f.seek(start)
    first = f.read(_INDEX_PEEK).split(b'"', 5)  # '', name, colon, file, comma, the rest
    if len(first) < 6 or first[0] or not _INDEX_COLON.fullmatch(first[2]) or not _INDEX_COMMA.fullmatch(first[4]):
        return None
    return metadata, start, _Gaps(first[2], first[4]), first[1]


def _rebuilt_tail(f: Any, end: int) -> bool:
    """Whether the index's bytes from `end` (where its last entry ends) on are only its closing braces."""
    f.seek(end)
    tail = f.read(_INDEX_TAIL_BYTES + 1)
    return len(tail) <= _INDEX_TAIL_BYTES and end + len(tail) <= MAX_INDEX_BYTES and bool(_INDEX_TAIL.fullmatch(tail))


class IndexProof:
    """The rebuilt proof of a large local index (`_rebuilt_index`) made shard by shard while the shards are read,
    rather than after: opened on the index before the scan (its head read once), `take(file, names)` with each shard's
    names as they arrive compares that shard's entries (`_shard_entries`) where it is the next shard in the index,
    and `proven(names)` is the whole proof's answer once every shard was taken. At the first thing it cannot prove
    (the shards listed in another order than they arrive, the index sorted by name, anything unusual) it stops, and
    `proven` gives None: the caller then proves the index whole, which decides as it always did.

    Each shard is compared once the next one arrives (or at `finish`), when it is known whether its entries are the
    index's last. Use it as a context manager: the index stays open from its start to `finish` (or its exit)."""

    def __init__(self, source: Source, files: dict[str, int]) -> None:
        self._name = _large_index(source, files)
        self._file: Any = None
        self._taken: dict[str, int] = {}  # file -> its tensors, every shard taken with one
        self._next: tuple[str, ShardNames] | None = None  # the shard taken last, compared once the next arrives
        self._order: _Order | None = None  # the order of the shard compared last (`_by_shard`'s)
        self._proven: tuple[str, dict[str, Any]] | None = None
        if self._name is None:
            return
        try:
            self._file = open_regular(source.local_path(self._name))
            head = _rebuilt_head(self._file)
        except _UNREAD:
            head = None
        if head is None:
            self._stop()
            return
        self._metadata, self._at, self._gaps, _first = head

    def __enter__(self) -> IndexProof:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop()

    def take(self, file: str, shard: ShardNames) -> None:
        """One more shard's names (in the order the shards arrive); one with no tensor is in no index."""
        if self._file is None or not shard.tensors:
            return
        if file in self._taken or not self._compare(last=False):
            self._stop()
            return
        self._taken[file] = shard.tensors
        self._next = file, shard

    def finish(self) -> None:
        """Every shard taken: the last one's entries compared as the index's last, then its closing braces."""
        if self._file is not None and self._next is not None and self._compare(last=True):
            try:
                if _rebuilt_tail(self._file, self._at) and self._name is not None:
                    self._proven = self._name, self._metadata
            except _UNREAD:
                pass
        self._stop()

    def proven(self, names: Mapping[str, ShardNames]) -> tuple[str, dict[str, Any]] | None:
        """(index file, its metadata) as `_rebuilt_index(source, files, names)` gives it, where the shards taken were
        exactly those of `names` that hold a tensor (as many each) and every one was proven as it arrived; else None
        (the caller proves the index whole)."""
        self.finish()
        held = {file: shard.tensors for file, shard in names.items() if shard.tensors}
        return self._proven if self._taken == held else None

    def _compare(self, last: bool) -> bool:
        """Whether the shard taken last, if any, is the next one in the index and its entries are proven there."""
        if self._next is None:
            return True
        file, shard = self._next
        try:  # (another shard's entries there differ from this one's text in its file)
            step = _shard_entries(self._file, self._at, file, shard, self._order, self._gaps, last)
        except _UNREAD:
            step = None
        if step is None:
            return False
        self._at, self._order = step
        self._next = None
        return True

    def _stop(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Gaps(NamedTuple):
    """The index's separators: between a name and its file (`:`), between two entries (`,`)."""

    colon: bytes
    comma: bytes

    def after(self, file: str) -> bytes:
        """What follows a name up to the next one: its file, quoted, and the next name's opening quote."""
        return b'"' + self.colon + b'"' + file.encode() + b'"' + self.comma + b'"'

    def written(self, found: bytes, entries: int, last: bool) -> bool:
        """Whether `entries` entries rebuilt as `found` are plain JSON: nothing inside a name or a file that JSON
        escapes, every quote and line break a separator's (`last`: no comma after the last entry)."""
        return found.isascii() and _escaped(found) == self._escaped(entries, last)

    def written_around(self, after: bytes, end: bytes, entries: int, last: bool) -> bool:
        """`written` of the text `"` + `after`.join(names) + `end` of `entries` names that hold nothing JSON escapes
        (`ShardNames.plain`), from its separators alone: the names' bytes are not read again."""
        ascii_ = end.isascii() and (entries < 2 or after.isascii())
        return ascii_ and 1 + (entries - 1) * _escaped(after) + _escaped(end) == self._escaped(entries, last)

    def _escaped(self, entries: int, last: bool) -> int:
        """How many bytes JSON escapes are in plain entries: four quotes each, the separators' line breaks."""
        return 4 * entries + entries * _spaces(self.colon) + (entries - last) * _spaces(self.comma)


def _by_shard(f: Any, at: int, names: Mapping[str, ShardNames], gaps: _Gaps) -> int | None:
    """Where the entries from `at` on end, where they are shard after shard (in any order of the shards) every name
    of each shard in one order (`_shard_entries`). One shard's entries (~1 MB at production size) are held at a
    time."""
    left = sum(shard.tensors for shard in names.values())
    order: _Order | None = None  # the last shard's order (positions in its header's names; None: as listed)
    written: set[str] = set()
    while left:
        file = _entry_file(f, at)  # the shard these entries are of
        shard = names.get(file) if file is not None and file not in written else None
        if file is None or shard is None or not shard.tensors:
            return None  # (a shard's entries not all in one run: the streamed proof decides)
        written.add(file)
        left -= shard.tensors
        step = _shard_entries(f, at, file, shard, order, gaps, not left)
        if step is None:
            return None
        at, order = step
    return at


def _entry_file(f: Any, at: int) -> str | None:
    """The file of the index's entry at `at`, where one starts there."""
    f.seek(at)
    entry = f.read(_INDEX_PEEK).split(b'"', 4)  # '', name, colon, file, ...
    return entry[3].decode("ascii") if len(entry) == 5 and not entry[0] else None


def _shard_entries(f: Any, at: int, file: str, shard: ShardNames, order: _Order | None, gaps: _Gaps, last: bool
                   ) -> tuple[int, _Order | None] | None:
    """(where they end, their order) of the entries from `at` on, where they are every name of `shard` with its
    `file`, in one order: `order` (the shard before it's: a writer writes each shard in its own order; None: as its
    header lists them), or else as the index says (read as names, once per shard written otherwise); `last`: the
    index's last entries (no comma after them). None otherwise."""
    after = gaps.after(file)
    end = after[:-1 - len(gaps.comma)] if last else after[:-1]
    head, rest = shard.joined_by(order, after)
    size = 1 + len(head) + len(rest) + len(end)
    f.seek(at)
    found = f.read(size)
    at += size
    if not _written_as(found, head, rest, end):
        order = _entries_order(found, shard)
        if order is None or not _written_as(found, *shard.joined_by(order, after), end):
            return None
    written = gaps.written_around(after, end, shard.tensors, last) if shard.plain else \
        gaps.written(found, shard.tensors, last)
    if at > MAX_INDEX_BYTES or not written:
        return None
    return at, order


def _written_as(found: bytes, head: bytes, rest: bytes, end: bytes) -> bool:
    """Whether `found` is `"` + `head` + `rest` + `end` (compared where they lie: no copy of ~1.4 MB a shard)."""
    return len(found) == 1 + len(head) + len(rest) + len(end) and found.startswith(b'"') and \
        found.startswith(head, 1) and found.startswith(rest, 1 + len(head)) and found.endswith(end)


def _entries_order(found: bytes, shard: ShardNames) -> _Order | None:
    """The order (positions in the shard's names) in which the entries `found` name each of them once; None where
    they do not (a name missing, twice or unknown), or are not plain entries."""
    tokens = found.split(b'"')
    if len(tokens) != 4 * shard.tensors + 1 or not found.isascii():
        return None
    return shard.order_of(tokens[1::4])


def _by_name(f: Any, at: int, names: Mapping[str, ShardNames], gaps: _Gaps) -> int | None:
    """Where the entries from `at` on end, where they are every name sorted, each with its file. Written and
    compared `_INDEX_NAMES` entries at a time."""
    after: dict[str, str] = {}  # name -> what follows it: its file
    for file, shard in names.items():
        after.update(dict.fromkeys(shard.listed() if shard.tensors else (), gaps.after(file).decode()))
    if len(after) != sum(shard.tensors for shard in names.values()):
        return None  # a name twice
    ordered = sorted(after)
    f.seek(at)
    for done in range(0, len(ordered), _INDEX_NAMES):
        chunk = ordered[done:done + _INDEX_NAMES]
        last = done + len(chunk) == len(ordered)
        parts = [""] * (2 * len(chunk))
        parts[::2] = chunk
        parts[1::2] = map(after.__getitem__, chunk)
        text = ('"' + "".join(parts)).encode()
        text = text[:-1 - len(gaps.comma)] if last else text[:-1]  # (the last entry: no comma after it)
        at += len(text)
        if at > MAX_INDEX_BYTES or f.read(len(text)) != text or not gaps.written(text, len(chunk), last):
            return None
    return at


def _plain(data: bytes) -> bool:
    """ASCII with no escape and no control character other than whitespace: every `"` delimits a string."""
    return data.isascii() and b"\\" not in data and len(data) == len(data.translate(None, _CONTROL))


def _last_entry_start(buffer: bytes) -> int:
    """Where the last name opens in `buffer`, which starts where one opens: its every fourth `"` opens a name (a
    name, its file: two strings of two quotes each). 0 while `buffer` holds no whole entry before it."""
    quotes = buffer.count(b'"')
    whole = (quotes - 1) // 4  # entries before the last name's quote
    if quotes < 5 or not whole:
        return 0
    at = len(buffer)
    for _ in range(quotes - 4 * whole):  # back over the quotes from the last name's on
        at = buffer.rfind(b'"', 0, at)
    return at


_INDEX_PIECE = 2 << 20  # bytes of the index read and split at a time
_INDEX_HEAD_BYTES = 1 << 20  # the most read before the first entry (the metadata object)
_INDEX_NAMES = 1 << 14  # entries of an index sorted by name rebuilt and compared at a time
_INDEX_PEEK = 1 << 16  # bytes read of an entry to see its separators or its file (a longer name: not proven)
_INDEX_TAIL_BYTES = 1 << 12  # the most read after the last entry (the closing braces)
_FILE_OF = attrgetter("file")


def _escaped(text: bytes) -> int:
    """How many bytes of `text` JSON writes escaped inside a string."""
    return len(text) - len(text.translate(None, _ESCAPED))


def _spaces(text: bytes) -> int:
    """How many line breaks and tabs `text` holds (counted, not copied: the index may be 80 MB)."""
    return text.count(b"\n") + text.count(b"\r") + text.count(b"\t")


_CONTROL = bytes(c for c in range(32) if c not in b"\n\r\t")
_ESCAPED = b'"\\' + bytes(range(32))  # what JSON writes escaped inside a string (a quote ends it)
_INDEX_HEAD = re.compile(rb'[ \t\n\r]*\{[ \t\n\r]*(?:"metadata"[ \t\n\r]*:[ \t\n\r]*(\{[^{}\[\]]*\})[ \t\n\r]*,'
                         rb'[ \t\n\r]*)?"weight_map"[ \t\n\r]*:[ \t\n\r]*\{[ \t\n\r]*')
_INDEX_COLON = re.compile(rb"[ \t\n\r]*:[ \t\n\r]*")
_INDEX_COMMA = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
_INDEX_TAIL = re.compile(rb"[ \t\n\r]*\}[ \t\n\r]*\}[ \t\n\r]*")


def read_json(source: Source, files: dict[str, int], name: str, findings: list[Finding],
              optional: bool = False) -> Any:
    """A JSON file or None; a bad one becomes a finding (a warning when the file is optional metadata)."""
    if name not in files:
        return None
    try:
        return source.read_json(name)
    except CheckFailed as e:
        make = warning if optional else error  # the code is the reader's (sources.read_json_file)
        findings.append(make(e.code or "json.unreadable", Location(file=name), str(e).split(": ", 1)[-1]))
        return None


def _read_index_json(source: Source, files: dict[str, int], name: str, findings: list[Finding]) -> Any:
    from trellis_cli.sources import MAX_JSON_BYTES

    size = files.get(name, 0)
    if size <= MAX_JSON_BYTES:
        return read_json(source, files, name, findings)
    if size > MAX_INDEX_BYTES:
        findings.append(error("json.too-large", Location(file=name), "index file is larger than the limit",
                              expected=f"<= {MAX_INDEX_BYTES} bytes", found=f"{size} bytes"))
        return None
    try:
        with open_regular(source.local_path(name)) as f:
            return load_json(f.read(MAX_INDEX_BYTES + 1))
    except OSError as e:
        findings.append(error("json.unreadable", Location(file=name), f"cannot read the file ({os_reason(e)})"))
    except (CheckFailed, JsonError) as e:
        findings.append(error("json.unreadable", Location(file=name), str(e)))
    return None


# ---- the gate ------------------------------------------------------------------------------------------------

def index_file_faults(ckpt: Checkpoint, named: Iterable[str]) -> Iterator[tuple[str, Finding]]:
    """Each file the index names (`named`, in sorted order) that leaves the checkpoint or is not listed, with its
    finding."""
    for file in sorted(named):
        if escapes(ckpt.source, file):
            yield file, error("path.escape", Location(file=ckpt.index_file), "index entry points outside the "
                              "checkpoint directory", expected="a relative path inside the checkpoint", found=file)
        elif file not in ckpt.files:
            yield file, error("index.file-missing", Location(file=ckpt.index_file), "index names a shard that does "
                              "not exist", found=file)


def byte_faults(ckpt: Checkpoint) -> Iterator[Finding]:
    """Every reason the checkpoint's bytes cannot be trusted as listed: what the opening could not read, an
    index naming a file that is not there, a header whose tensors run past the end of its file."""
    for f in ckpt.parse_findings:
        if f.severity is Severity.ERROR and (f.code.startswith(BYTE_FAULT_PREFIXES) or f.code in BYTE_FAULT_CODES
                                             or (f.code.startswith("json.") and (f.where.file or "").endswith(INDEX_SUFFIX))):
            yield f
    if ckpt.index:
        for _file, fault in index_file_faults(ckpt, files_named(ckpt.index)):
            yield fault
    for file, header in ckpt.headers.items():
        end = header.data_start + header.data_end
        if header.file_size is not None and end > header.file_size:
            yield error("file.truncated", Location(file=file), f"bytes [{header.data_start}, {end}) of its tensors "
                        f"run past the end of the {header.file_size}-byte file", expected=f"{end} bytes",
                        found=f"{header.file_size} bytes")


def require_intact(ckpt: Checkpoint, what: str) -> None:
    """Refuse to answer `what` from a checkpoint whose bytes cannot all be read as listed: CheckFailed naming
    the first fault (file, finding code, expected vs found) and how many there are."""
    faults = list(byte_faults(ckpt))
    if not faults:
        return
    first = faults[0]
    where = first.where.file or "the checkpoint"
    facts = [f"expected {first.expected}"] if first.expected is not None else []
    facts += [f"found {first.found}"] if first.found is not None else []
    detail = f"{first.message} ({', '.join(facts)})" if facts else first.message
    more = f"; {len(faults) - 1} more fault(s)" if len(faults) > 1 else ""
    raise CheckFailed(f"{where}: {detail} [{first.code}]{more}: {what} needs every file of the checkpoint readable "
                      f"(run `trellis validate` for every finding)", code=first.code)


__all__ = ["BYTE_FAULT_CODES", "HeaderNames", "IndexProof", "byte_faults", "canonical_header", "each_scanned",
           "escapes", "every_header_names", "index_file_faults", "header_names", "listing", "index_files", "listing_findings", "raw_header",
           "read_headers", "read_index", "read_json", "require_intact", "same_bytes", "scan_shards", "ShardNames",
           "shard_columns", "shard_names", "shard_header", "source_header"]
