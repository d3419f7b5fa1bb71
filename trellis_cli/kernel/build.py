"""nvcc build of the bundled kernel library, cached per (source hash, arch, nvcc version).

The CUDA C++ sources ship with the package (`kernels/`). The first use on a machine compiles them into a
shared library for the GPU present (or the arch asked for) under the user's cache directory
($XDG_CACHE_HOME or ~/.cache)/trellis/kernels. The library is written to a temporary file and moved into
place with os.replace, so a concurrent or interrupted build never leaves a half-written .so behind.
Every failure (no nvcc, no GPU to pick an arch from, a compile error) is a GpuUnavailable (exit 4) whose
message carries the compiler's output after the first line.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trellis_cli.errors import GpuUnavailable

LIBRARY_STEM = "trellis_moe"
ENTRY_SOURCE = "trellis_moe.cu"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h")
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")
BUILD_TIMEOUT_S = 900
_COMPILER_LOG_LINES = 40


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path
    arch: str  # "sm_90"
    build_hash: str  # 16 hex digits over sources, arch, nvcc version and flags
    nvcc_version: str
    cached: bool  # True when an earlier build was reused


def kernel_source_dir() -> Path:
    """The kernels/ directory: packaged inside trellis_cli, or at the repository root in a checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / ENTRY_SOURCE).is_file():
            return candidate
    raise GpuUnavailable(f"kernel sources not found: no {ENTRY_SOURCE} in trellis_cli/kernels or kernels/")


def source_hash(source_dir: Path | None = None) -> str:
    """sha256 over the names and bytes of every kernel source file, in name order."""
    directory = source_dir or kernel_source_dir()
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.suffix in SOURCE_SUFFIXES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def find_nvcc() -> str:
    """nvcc from $TRELLIS_NVCC, PATH, $CUDA_HOME/bin or /usr/local/cuda/bin."""
    candidates = [os.environ.get("TRELLIS_NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise GpuUnavailable("nvcc not found: install the CUDA toolkit or set CUDA_HOME (needed to build the kernel)")


def nvcc_version(nvcc: str) -> str:
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise GpuUnavailable(f"cannot run {nvcc} --version: {err}") from None
    match = re.search(r"release [\d.]+, V([\d.]+)", text)
    if not match:
        raise GpuUnavailable(f"cannot read the nvcc version from `{nvcc} --version`\n{text.strip()}")
    return match.group(1)


def normalize_arch(arch: str) -> str:
    """'sm_90', '90', '9.0' or 'compute_90' -> 'sm_90'; sm_80 is the oldest supported."""
    text = arch.strip().lower()
    match = re.fullmatch(r"(?:sm_|compute_)?(\d)\.?(\d)", text) or re.fullmatch(r"(?:sm_|compute_)?(\d\d)(\d)", text)
    if not match:
        raise GpuUnavailable(f"unknown GPU arch {arch!r}: expected e.g. sm_90 or sm_80")
    number = int("".join(match.groups()))
    if number < 80:
        raise GpuUnavailable(f"GPU arch sm_{number} is too old: the kernel needs sm_80 or newer")
    return f"sm_{number}"


def device_arch() -> str:
    """The arch of the current CUDA device; GpuUnavailable when there is none."""
    import torch

    if not torch.cuda.is_available():
        raise GpuUnavailable("no CUDA device visible: pass --arch to build without a GPU")
    major, minor = torch.cuda.get_device_capability()
    return normalize_arch(f"{major}{minor}")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trellis" / "kernels"


def arch_flags(arch: str) -> list[str]:
    """Code generation for `arch`. Hopper builds its arch-specific target (sm_90a), which has wgmma: the
    large-tile GEMM then runs on it (kernels/expert_wgmma.cuh); every other arch uses mma.sync only."""
    number = arch.removeprefix("sm_")
    if number == "90":
        return ["-gencode=arch=compute_90a,code=sm_90a", "-DTRELLIS_WGMMA"]
    return [f"-gencode=arch=compute_{number},code=sm_{number}"]


def nvcc_command(nvcc: str, arch: str, source: Path, output: Path) -> list[str]:
    return [nvcc, *NVCC_FLAGS, *arch_flags(arch), "-o", str(output), str(source)]


def build_library(arch: str | None = None, *, force: bool = False) -> BuiltLibrary:
    """The compiled kernel library for `arch` (default: the current GPU's), building it if not cached."""
    target = normalize_arch(arch) if arch else device_arch()
    source_dir = kernel_source_dir()
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    key = hashlib.sha256(
        "|".join((source_hash(source_dir), target, version, " ".join((*NVCC_FLAGS, *arch_flags(target))))).encode()
    ).hexdigest()[:16]
    directory = cache_dir()
    path = directory / f"{LIBRARY_STEM}-{target}-{key}.so"
    if path.is_file() and not force:
        return BuiltLibrary(path, target, key, version, cached=True)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise GpuUnavailable(f"cannot create the kernel cache directory {directory}: {err}") from None
    _compile(nvcc, target, source_dir / ENTRY_SOURCE, path)
    return BuiltLibrary(path, target, key, version, cached=False)


def _compile(nvcc: str, arch: str, source: Path, path: Path) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            result = subprocess.run(
                nvcc_command(nvcc, arch, source, tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise GpuUnavailable(f"kernel build for {arch} timed out after {BUILD_TIMEOUT_S} s") from None
        except OSError as err:
            raise GpuUnavailable(f"cannot run nvcc: {err}") from None
        if result.returncode != 0:
            log = "\n".join((result.stderr or result.stdout).strip().splitlines()[-_COMPILER_LOG_LINES:])
            raise GpuUnavailable(f"kernel build failed for {arch} (nvcc exit {result.returncode})\n{log}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
