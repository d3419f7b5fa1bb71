"""GPU memory: named presets for the cards these users run, `--gpu-mem` sizes, and a visible local GPU.

A preset is the total memory the driver reports for the card (nvidia-smi's `memory.total`, in MiB), which is
what the engine multiplies by `--gpu-memory-utilization`; the marketing "96 GB" is not that number.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from trellis_cli.errors import UsageError

MIB = 1 << 20
GIB = 1 << 30


class Gpu(NamedTuple):
    name: str
    description: str
    total_bytes: int


# memory.total as the driver reports it (MiB).
PRESETS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("rtx-pro-6000", "RTX PRO 6000 Blackwell (96 GB GDDR7)", 97_887 * MIB),
    Gpu("h100", "H100 80 GB (SXM/PCIe)", 81_559 * MIB),
    Gpu("h200", "H200 141 GB", 143_771 * MIB),
    Gpu("b200", "B200 180 GB", 183_359 * MIB),
)}

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, option: str = "--gpu-mem") -> int:
    """`96GiB`, `80GB`, `102641958912` -> bytes (GB = 10^9, GiB = 2^30)."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise UsageError(f"{option}: {text!r} is not a size (e.g. 96GiB, 80GB or a byte count)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UsageError(f"{option}: {text!r} must be larger than zero")
    return size


def preset(name: str) -> Gpu:
    if name not in PRESETS:
        raise UsageError(f"--gpu: unknown GPU {name!r} (known: {', '.join(PRESETS)}; or give --gpu-mem SIZE)")
    return PRESETS[name]


def local_gpu() -> Gpu | None:
    """The first visible CUDA device, when torch sees one (its total memory as the driver reports it)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Gpu("local", f"{props.name} (device 0)", int(props.total_memory))


def choose_gpu(name: str | None, mem: str | None) -> Gpu:
    """--gpu NAME, or --gpu-mem SIZE, or the local GPU; a usage error when none is given and none is visible."""
    if name is not None and mem is not None:
        raise UsageError("--gpu and --gpu-mem are exclusive: give one")
    if name is not None:
        return preset(name)
    if mem is not None:
        return Gpu("custom", "--gpu-mem", parse_size(mem))
    found = local_gpu()
    if found is None:
        raise UsageError(f"no GPU visible here: give --gpu NAME ({', '.join(PRESETS)}) or --gpu-mem SIZE")
    return found
