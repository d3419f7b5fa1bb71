"""nvcc build of the bundled kernel library: translation units compiled in parallel, each object cached.

The CUDA C++ sources ship with the package (`kernels/`). A library serves one codebook: it links the host
unit (`trellis_moe.cu`: argument checks, launch sequence, route pack, rotation, activation, top-k sum)
with that codebook's GEMM units (`gemm_unit.cu`, compiled once per tile family and K-set; `kernels/gemm_table.h`).
A run builds only the codebook of the layer it serves (mcg for every TR3 checkpoint), and another on first
use; and of that codebook only the K3/K4 kernels where the layer's tiers are all K3 or K4 (every TR3
checkpoint: the "k3k4" kernel set), the kernels of every K ("all") where they are not. Every object is
cached under its own hash (its source and the headers it includes, the flags, the arch and the nvcc
version), so a change recompiles only the units it touches; a library is cached under the hash of its
objects.

The cache is $TRELLIS_KERNEL_CACHE, or ($XDG_CACHE_HOME or ~/.cache)/trellis/kernels. The units compile
$TRELLIS_BUILD_JOBS at a time (default: one per CPU core, os.cpu_count()); where there are more cores
than units, the longest units get several compiler threads each (unit_threads). There is no time limit; a
compiler that uses no CPU time for $TRELLIS_BUILD_STALL_S seconds (default 300) is killed (jobs.py). Every
file is written under a temporary name and moved into place, so a concurrent or interrupted build never
leaves half a file behind. Every failure (no nvcc, no GPU to pick an arch from, a compile error) is a
GpuUnavailable (exit 4) whose message carries the compiler's output after the first line.

One hook lets a caller build something else with the same machinery: a BuildExtension names a source
directory compiled instead of kernels/, defines added to every unit, optionally one source that holds a
codebook's whole library as a single unit, and a name that its units and library carry, so that they are
cached apart from the product's. The product passes none; its sources know of no extension.
`build_commands` gives the nvcc command lines of any build.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from trellis_cli.codebooks import IDS as CODEBOOK_IDS
from trellis_cli.errors import GpuUnavailable, UsageError
from trellis_cli.kernel.jobs import Job, run_jobs
from trellis_cli.kernel.resources import parse_ptxas, read_raw_record, record_path, write_record
from trellis_cli.kernel.nvcc import (  # noqa: F401  (re-exported: the build's public names)
    COMPILE_FLAGS,
    arch_flags,
    device_arch,
    find_nvcc,
    has_wgmma,
    normalize_arch,
    nvcc_version,
)

LIBRARY_STEM = "trellis_moe"
HOST_SOURCE = "trellis_moe.cu"
GEMM_SOURCE = "gemm_unit.cu"
SINGLE_UNIT = "single"  # the kind of a unit that holds a codebook's whole library (BuildExtension.single_source)
SOURCE_SUFFIXES = (".cu", ".cuh", ".h")
# kernels/gemm_table.h TileFamily and KSet, in their order; wgmma only where the arch has it. The K3/K4
# kernels and the all-K kernels of a family compile as two units.
TILE_FAMILIES = ("mma16", "mma32", "mma128", "wgmma")
K_SETS = ("allk", "k3k4")
# Which K-sets a library holds: "k3k4", the kernels of layers whose tiers are all K3 or K4 (every TR3
# checkpoint; less than half the compile time of the whole library), or "all", every K from 1 to 8.
KERNEL_SETS = {"all": K_SETS, "k3k4": ("k3k4",)}
FAST_K = (3, 4)
# The order codebooks are built in when all are asked for: mcg, the codebook of every TR3 checkpoint, first.
BUILD_ORDER = ("mcg", "3inst", "mul1")
DEFAULT_STALL_S = 300.0
# CPU seconds each unit takes to compile for sm_90 on the 2-core reference machine (docs/performance.md,
# "Kernel build time"): units start longest first, and the estimate said before a cold build comes from
# these.
UNIT_SECONDS = {"host": 7.0, "mma16-allk": 18.0, "mma16-k3k4": 6.0, "mma32-allk": 22.0, "mma32-k3k4": 7.0,
                "mma128-allk": 14.0, "mma128-k3k4": 4.0, "wgmma-allk": 18.0, "wgmma-k3k4": 36.0}
# Most compiler threads one unit gets (unit_threads): a GEMM unit's K3/K4 kernels are four (FC1 and FC2,
# narrow and wide), and its all-K kernels split into a few more.
MAX_UNIT_THREADS = 4
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)
_EXTENSION_NAME = re.compile(r"[a-z][a-z0-9]*")


@dataclass(frozen=True)
class BuildExtension:
    """Other sources built by the product's machinery, for a caller that instruments the kernels outside the
    product (docs/kernel.md, "Build extensions"). The product build passes none."""

    name: str  # its units are "<name>-<unit>", its library "trellis_moe_<name>...": cached apart from the product's
    source_dir: Path  # compiled instead of kernels/
    defines: tuple[str, ...] = ()  # added to every unit, before the unit's own
    single_source: str = ""  # if set, a codebook's whole library is this one unit of source_dir

    def __post_init__(self) -> None:
        if not _EXTENSION_NAME.fullmatch(self.name):
            raise UsageError(f"build extension name {self.name!r}: expected lower-case letters and digits")
        if self.single_source and not (Path(self.source_dir) / self.single_source).is_file():
            raise UsageError(f"build extension {self.name}: no {self.single_source} in {self.source_dir}")


@dataclass(frozen=True)
class Unit:
    """One translation unit of the library."""

    name: str  # "host" or "<codebook>-<family>-<K-set>", e.g. "mcg-mma16-k3k4"; an extension's "<name>-host", ...
    source: str  # file in kernels/ (or the extension's source directory)
    defines: tuple[str, ...] = ()
    kind: str = ""  # the unit without codebook or extension ("host", "mma16-k3k4"): its compile time

    @property
    def seconds(self) -> float:
        if self.kind == SINGLE_UNIT:  # every unit of a library at once
            return sum(UNIT_SECONDS.values())
        return UNIT_SECONDS.get(self.kind, max(UNIT_SECONDS.values()))


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path
    arch: str  # "sm_90"
    build_hash: str  # 16 hex digits over the library's objects (each: sources, flags, arch, nvcc version)
    nvcc_version: str
    cached: bool  # True when an earlier build was reused
    codebook: str = "mcg"  # the codebook whose kernels it holds
    extension: str = ""  # the BuildExtension's name; "" for the product library
    kernels: str = "all"  # the K-sets it holds (KERNEL_SETS)


@dataclass(frozen=True)
class BuildReport:
    libraries: list[BuiltLibrary]
    units: int  # translation units the libraries need
    compiled: int  # of them compiled now (the rest came from the cache)
    jobs: int
    seconds: float


def kernel_source_dir() -> Path:
    """The kernels/ directory: packaged inside trellis_cli, or at the repository root in a checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / HOST_SOURCE).is_file():
            return candidate
    raise GpuUnavailable(f"kernel sources not found: no {HOST_SOURCE} in trellis_cli/kernels or kernels/")


def source_hash(source_dir: Path | None = None) -> str:
    """sha256 over the names and bytes of every kernel source file, in name order."""
    directory = source_dir or kernel_source_dir()
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.suffix in SOURCE_SUFFIXES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_dir() -> Path:
    if os.environ.get("TRELLIS_KERNEL_CACHE"):
        return Path(os.environ["TRELLIS_KERNEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trellis" / "kernels"


def build_jobs(jobs: int | None = None) -> int:
    """Units compiled at once: `jobs`, else $TRELLIS_BUILD_JOBS, else one per CPU core."""
    if jobs is None:
        text = os.environ.get("TRELLIS_BUILD_JOBS", "").strip()
        if not text:
            return os.cpu_count() or 1
        if not text.isdigit():
            raise UsageError(f"TRELLIS_BUILD_JOBS={text!r}: expected a positive number of parallel compiles")
        jobs = int(text)
    if jobs < 1:
        raise UsageError(f"build jobs must be at least 1 (got {jobs})")
    return jobs


def stall_seconds() -> float:
    text = os.environ.get("TRELLIS_BUILD_STALL_S", "").strip()
    try:
        value = float(text) if text else DEFAULT_STALL_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"TRELLIS_BUILD_STALL_S={text!r}: expected a positive number of seconds")
    return value


def check_codebook(codebook: str) -> str:
    if codebook not in CODEBOOK_IDS:
        raise UsageError(f"unknown codebook {codebook!r}: expected one of {', '.join(BUILD_ORDER)}")
    return codebook


def check_kernels(kernels: str) -> str:
    if kernels not in KERNEL_SETS:
        raise UsageError(f"unknown kernel set {kernels!r}: expected one of {', '.join(KERNEL_SETS)}")
    return kernels


def kernels_for(tier_bits: Iterable[int]) -> str:
    """The smallest kernel set that serves a layer whose (non-empty) tiers have these K."""
    return "k3k4" if all(k in FAST_K for k in tier_bits) else "all"


def library_units(arch: str, codebook: str, kernels: str = "all", extension: BuildExtension | None = None) -> list[Unit]:
    """The host unit and the codebook's GEMM units: one per tile family the arch runs and K-set of
    `kernels` (an extension with a single source: the whole library as that one unit)."""
    cb = CODEBOOK_IDS[check_codebook(codebook)]
    k_sets = KERNEL_SETS[check_kernels(kernels)]
    extra, prefix = (extension.defines, f"{extension.name}-") if extension else ((), "")
    if extension and extension.single_source:
        return [Unit(f"{prefix}{codebook}", extension.single_source, (*extra, f"-DTRELLIS_UNIT_CODEBOOK={cb}"),
                     SINGLE_UNIT)]
    families = [f for f in TILE_FAMILIES if f != "wgmma" or has_wgmma(arch)]
    return [Unit(f"{prefix}host", HOST_SOURCE, extra, "host")] + [
        Unit(f"{prefix}{codebook}-{family}-{kset}", GEMM_SOURCE,
             (*extra, f"-DTRELLIS_UNIT_CODEBOOK={cb}", f"-DTRELLIS_UNIT_FAMILY={TILE_FAMILIES.index(family)}",
              f"-DTRELLIS_UNIT_KSETS={1 << K_SETS.index(kset)}"), f"{family}-{kset}")
        for family in families for kset in k_sets
    ]


def library_stem(kernels: str = "all", extension: BuildExtension | None = None) -> str:
    """trellis_moe, or trellis_moe_<extension name>: an extension's library never takes the product's name;
    a library of the K3/K4 kernels alone ends in _k3k4."""
    stem = f"{LIBRARY_STEM}_{extension.name}" if extension else LIBRARY_STEM
    return stem if check_kernels(kernels) == "all" else f"{stem}_{kernels}"


def source_dir_of(extension: BuildExtension | None) -> Path:
    return Path(extension.source_dir) if extension else kernel_source_dir()


def build_commands(arch: str, codebook: str = "mcg", nvcc: str = "nvcc", kernels: str = "all",
                   extension: BuildExtension | None = None) -> list[list[str]]:
    """The nvcc command lines that build one library: one compile per unit (into <unit>.o), then the link
    (into <library stem>.so), as build_library runs them."""
    target, directory = normalize_arch(arch), source_dir_of(extension)
    units = library_units(target, codebook, kernels, extension)
    objects = [Path(f"{u.name}.o") for u in units]
    return ([compile_command(nvcc, target, u, directory, o) for u, o in zip(units, objects)]
            + [link_command(nvcc, objects, Path(f"{library_stem(kernels, extension)}-{target}-{codebook}.so"))])


def unit_sources(source_dir: Path, source: str) -> list[str]:
    """`source` and every kernels/ header it includes, directly or not, in name order."""
    seen, todo = set(), [source]
    while todo:
        name = todo.pop()
        if name in seen or not (source_dir / name).is_file():
            continue
        seen.add(name)
        todo += [m.decode() for m in _INCLUDE.findall((source_dir / name).read_bytes())]
    return sorted(seen)


def compile_command(nvcc: str, arch: str, unit: Unit, source_dir: Path, output: Path, threads: int = 1) -> list[str]:
    """One unit's nvcc line; with `threads` > 1, nvcc optimizes and assembles the unit's kernels that many at
    a time (-split-compile: the same code, so the object's hash leaves it out)."""
    split = [f"-split-compile={threads}"] if threads > 1 else []
    return [nvcc, "-c", *COMPILE_FLAGS, *arch_flags(arch), *unit.defines, *split, "-o", str(output),
            str(source_dir / unit.source)]


def link_command(nvcc: str, objects: Iterable[Path], output: Path) -> list[str]:
    return [nvcc, "-shared", "-o", str(output), *map(str, objects)]


def unit_hash(unit: Unit, arch: str, version: str, source_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in unit_sources(source_dir, unit.source):
        digest.update(name.encode() + b"\0" + (source_dir / name).read_bytes() + b"\0")
    flags = compile_command("nvcc", arch, unit, Path(), Path())
    digest.update("|".join((unit.name, arch, version, *flags)).encode())
    return digest.hexdigest()[:16]


def build_library(arch: str | None = None, codebook: str = "mcg", *, kernels: str = "all", jobs: int | None = None,
                  force: bool = False, log: Callable[[str], None] | None = None,
                  extension: BuildExtension | None = None) -> BuiltLibrary:
    """The kernel library of `codebook` for `arch` (default: the current GPU's), building what is not cached."""
    return build_libraries(arch, (codebook,), kernels=kernels, jobs=jobs, force=force, log=log,
                           extension=extension).libraries[0]


def build_libraries(arch: str | None = None, codebooks: Iterable[str] = BUILD_ORDER, *, kernels: str = "all",
                    jobs: int | None = None, force: bool = False, log: Callable[[str], None] | None = None,
                    extension: BuildExtension | None = None) -> BuildReport:
    """One library per codebook, their units compiled together (shared ones once), then each linked."""
    started = time.monotonic()
    check_kernels(kernels)
    target = normalize_arch(arch) if arch else device_arch()
    codebooks = list(dict.fromkeys(check_codebook(c) for c in codebooks))
    parallel = build_jobs(jobs)
    source_dir, nvcc = source_dir_of(extension), find_nvcc()
    version = nvcc_version(nvcc)
    directory = cache_dir()
    objects = directory / "objects"
    try:
        objects.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise GpuUnavailable(f"cannot create the kernel cache directory {objects}: {err}") from None
    per_library = {c: library_units(target, c, kernels, extension) for c in codebooks}
    paths: dict[Unit, Path] = {}
    for unit in (u for units in per_library.values() for u in units):
        paths.setdefault(unit, objects / f"{unit.name}-{target}-{unit_hash(unit, target, version, source_dir)}.o")
    missing = [u for u, p in paths.items() if force or not p.is_file() or not record_path(p).is_file()]
    _compile_units(nvcc, target, source_dir, missing, paths, parallel, log, started)
    libraries = [_link(nvcc, target, version, c, extension, kernels, [paths[u] for u in per_library[c]], directory,
                       force) for c in codebooks]
    if log and missing:
        log(f"kernel build for {target} done in {_clock(time.monotonic() - started)}")
    return BuildReport(libraries, len(paths), len(missing), parallel, time.monotonic() - started)


def unit_threads(units: list[Unit], parallel: int) -> dict[Unit, int]:
    """Compiler threads per unit: its share of the `parallel` cores by its compile time, rounded up, at least
    1 and at most MAX_UNIT_THREADS (about the kernels a unit holds). A unit longer than the build's share
    of one core would otherwise keep a many-core machine waiting on it alone (the K3/K4 wgmma unit: 36 of
    the mcg library's 132 CPU seconds), while a build of many units gives each one thread."""
    total = sum(u.seconds for u in units) or 1.0
    return {u: max(1, min(MAX_UNIT_THREADS, math.ceil(parallel * u.seconds / total))) for u in units}


def cold_build_estimate(units: list[Unit], parallel: int) -> float:
    """Seconds a cold build of `units` takes `parallel` at a time on the reference 2-core machine."""
    threads = unit_threads(units, parallel)
    longest = max((u.seconds / threads[u] for u in units), default=0.0)  # a unit's kernels split over its threads
    return max(longest, sum(u.seconds for u in units) / min(parallel, os.cpu_count() or 1, max(len(units), 1)))


def _compile_units(nvcc: str, arch: str, source_dir: Path, units: list[Unit], paths: dict[Unit, Path],
                   parallel: int, log: Callable[[str], None] | None, started: float) -> None:
    if not units:
        return
    units = sorted(units, key=lambda u: -u.seconds)  # longest first: the last to start are short
    if log:
        estimate = cold_build_estimate(units, parallel)
        log(f"kernel build for {arch}: compiling {len(units)} of {len(paths)} units, {parallel} at a time "
            f"(--jobs, TRELLIS_BUILD_JOBS); a cold build of these takes about {_clock(estimate)} at the speed "
            f"of a 2-core reference machine")
    jobs, threads = [], unit_threads(units, parallel)
    for unit in units:
        fd, tmp = tempfile.mkstemp(prefix=f".{paths[unit].stem}-", suffix=".o.tmp", dir=paths[unit].parent)
        os.close(fd)
        command = compile_command(nvcc, arch, unit, source_dir, Path(tmp), threads[unit])
        jobs.append(Job(f"{arch} unit {unit.name}", command, Path(tmp), paths[unit],
                        keep_log=Path(f"{tmp}.log")))
    done = 0

    def report(job: Job, seconds: float) -> None:
        nonlocal done
        done += 1
        if job.keep_log is not None:  # ptxas's numbers, recorded beside the object
            try:
                write_record(record_path(job.output), arch, parse_ptxas(job.keep_log.read_text(errors="replace")))
            except OSError as err:
                raise GpuUnavailable(f"cannot record the resource usage of {job.label}: {err}") from None
            job.keep_log.unlink(missing_ok=True)
        if log:
            log(f"kernel build: {done}/{len(jobs)} units, {job.label.rpartition(' ')[2]} took {seconds:.0f} s, "
                f"{_clock(time.monotonic() - started)} elapsed")

    try:
        run_jobs(jobs, parallel=parallel, stall_s=stall_seconds(), on_done=report)
    finally:
        for job in jobs:
            job.tmp_output.unlink(missing_ok=True)
            if job.keep_log is not None:
                job.keep_log.unlink(missing_ok=True)


def _merge_records(objects: list[Path], library: Path, arch: str) -> None:
    kernels: dict[str, dict[str, int]] = {}
    for obj in objects:
        kernels.update(read_raw_record(record_path(obj)))
    try:
        write_record(record_path(library), arch, kernels)
    except OSError as err:
        raise GpuUnavailable(f"cannot record the resource usage of {library.name}: {err}") from None


def _link(nvcc: str, arch: str, version: str, codebook: str, extension: BuildExtension | None, kernels: str,
          objects: list[Path], directory: Path, force: bool) -> BuiltLibrary:
    key = hashlib.sha256("|".join((*[p.name for p in objects], *link_command("nvcc", [], Path()))).encode())
    build_hash = key.hexdigest()[:16]
    path = directory / f"{library_stem(kernels, extension)}-{arch}-{codebook}-{build_hash}.so"
    name = extension.name if extension else ""
    if path.is_file() and not force:
        if not record_path(path).is_file():
            _merge_records(objects, path, arch)
        return BuiltLibrary(path, arch, build_hash, version, cached=True, codebook=codebook, extension=name,
                            kernels=kernels)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so.tmp", dir=directory)
    os.close(fd)
    try:
        run_jobs([Job(f"{arch} {codebook} library", link_command(nvcc, objects, Path(tmp)), Path(tmp), path)],
                 parallel=1, stall_s=stall_seconds())
    finally:
        Path(tmp).unlink(missing_ok=True)
    _merge_records(objects, path, arch)
    return BuiltLibrary(path, arch, build_hash, version, cached=False, codebook=codebook, extension=name,
                        kernels=kernels)


def _clock(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"
