"""The CUDA toolchain the kernel build uses: where nvcc is, its version, the GPU arch and its flags.

Every failure is a GpuUnavailable (exit 4).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from trellis_cli.errors import GpuUnavailable

# Flags of every translation unit (build.py adds the arch's code generation and the unit's defines).
# --resource-usage: ptxas reports each kernel's registers and static shared memory, which the build records
# beside the object (kernel/resources.py) and the launch plan is checked with.
COMPILE_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", "--resource-usage")


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


# Test-only: TRELLIS_MMA_SYNC_ONLY=1 builds sm_90 as every other arch, without wgmma (the portable path that
# sm_80, sm_100 and sm_12x run), so that path can be run and timed on a Hopper GPU (docs/kernel.md).
MMA_SYNC_ONLY_ENV = "TRELLIS_MMA_SYNC_ONLY"


def mma_sync_only() -> bool:
    return os.environ.get(MMA_SYNC_ONLY_ENV, "").strip() not in ("", "0")


def arch_flags(arch: str) -> list[str]:
    """Code generation for `arch`. Hopper builds its arch-specific target (sm_90a), which has wgmma: the
    large-tile GEMM then runs on it (kernels/expert_wgmma.cuh); every other arch uses mma.sync only (and
    sm_90 too under TRELLIS_MMA_SYNC_ONLY)."""
    number = arch.removeprefix("sm_")
    if number == "90" and not mma_sync_only():
        return ["-gencode=arch=compute_90a,code=sm_90a", "-DTRELLIS_WGMMA"]
    return [f"-gencode=arch=compute_{number},code=sm_{number}"]


def has_wgmma(arch: str) -> bool:
    return "-DTRELLIS_WGMMA" in arch_flags(arch)
