"""What a benchmark ran on: GPU, clocks, driver, CUDA, torch and the kernel build."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from typing import Any

import torch

from trellis_cli.kernel.abi import KernelLibrary
from trellis_cli.kernel.arch_limits import device_limits

_SMI_FIELDS = ("driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.limit", "temperature.gpu")


def nvidia_smi(index: int) -> dict[str, str]:
    """A few nvidia-smi fields for GPU `index`; empty when nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    try:
        result = subprocess.run(
            [smi, f"--id={index}", f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in result.stdout.strip().split(",")]
    return dict(zip(_SMI_FIELDS, values)) if result.returncode == 0 and len(values) == len(_SMI_FIELDS) else {}


def environment(library: KernelLibrary, device: torch.device | None = None) -> dict[str, Any]:
    device = device or torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "l2_bytes": int(getattr(props, "L2_cache_size", 0)),
        "memory_bytes": int(props.total_memory),
        "nvidia_smi": nvidia_smi(device.index or 0),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "kernel": {
            "build_hash": library.build_hash,
            "arch": library.arch,
            "nvcc": library.nvcc_version,
            "path": str(library.path),
            "large_tiles": "wgmma" if library.wgmma else "mma.sync",
            "plan_limits": dataclasses.asdict(device_limits(device.index)),
        },
    }


def kernel_line(library: KernelLibrary, device: torch.device | None = None) -> str:
    """What `trellis bench` says before it runs: the arch, the GEMM path and the limits its plans are made for."""
    limits = device_limits((device or torch.device("cuda", torch.cuda.current_device())).index)
    path = "wgmma" if library.wgmma else "mma.sync"
    return (f"kernel: built for {library.arch}, large tiles on {path}; plans for {limits.describe()} "
            f"({limits.source} limits)")
