"""GPU memory and family: named presets for the cards these users run, `--gpu-mem` sizes, and a visible local GPU.

A preset is the total memory the driver reports for the card (nvidia-smi's `memory.total`, in MiB), which is
what the engine multiplies by `--gpu-memory-utilization`; the marketing "96 GB" is not that number. A preset
also knows the card's family (sm_90 / sm_100 / sm_120), from which the engine picks its attention backend;
a bare size does not, so `--gpu-mem` needs `--arch`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from trellis_cli.errors import UsageError
from trellis_cli.fit.engines import SM90, SM100, SM120, family_name

MIB = 1 << 20
GIB = 1 << 30
MAX_GPU_BYTES = 1 << 50  # 1 PiB: past any card; a larger size is a typo, not a GPU


class Gpu(NamedTuple):
    name: str
    description: str
    total_bytes: int
    family: str | None = None  # sm_90 / sm_100 / sm_120; None: not known (a bare --gpu-mem)


# memory.total as the driver reports it (MiB).
PRESETS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("rtx-pro-6000", "RTX PRO 6000 Blackwell (96 GB GDDR7)", 97_887 * MIB, SM120),
    Gpu("h100", "H100 80 GB (SXM/PCIe)", 81_559 * MIB, SM90),
    Gpu("h200", "H200 141 GB", 143_771 * MIB, SM90),
    Gpu("b200", "B200 180 GB", 183_359 * MIB, SM100),
)}
# The names users type, after lower-casing and turning spaces and underscores into hyphens.
ALIASES = {"rtx-pro-6000-blackwell": "rtx-pro-6000", "rtxpro6000": "rtx-pro-6000", "pro-6000": "rtx-pro-6000",
           "rtx-6000-pro": "rtx-pro-6000", "h100-sxm": "h100", "h100-pcie": "h100", "h100-80gb": "h100",
           "h200-sxm": "h200", "h200-nvl": "h200", "b200-sxm": "b200"}

_UNITS = {"kb": 1000, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": MIB, "gib": GIB,
          "tib": 1 << 40, "b": 1}
_SIZE = re.compile(r"^\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, option: str = "--gpu-mem") -> int:
    """`96GiB`, `80GB`, `102641958912B` -> bytes (GB = 10^9, GiB = 2^30). A bare number is refused: 96 could
    be bytes, GB or GiB, and each reading gives another verdict."""
    m = _SIZE.match(text)
    if m is None:
        raise UsageError(f"{option}: {_clip(text)} is not a size (e.g. 96GiB, 80GB, or bytes as 1024B)")
    number, unit = m.group(1), m.group(2).lower()
    if unit == "":
        raise UsageError(f"{option}: {text.strip()} has no unit: write {text.strip()}GiB (binary, as nvidia-smi "
                         f"counts) or {text.strip()}GB (decimal), or {text.strip()}B for bytes")
    if unit not in _UNITS:
        raise UsageError(f"{option}: unknown unit {m.group(2)!r} in {_clip(text)} (B, KB, MB, GB, TB, KiB, MiB, "
                         "GiB, TiB)")
    whole, _, frac = number.partition(".")
    size = int(whole) * _UNITS[unit] + (int(frac) * _UNITS[unit] // 10 ** len(frac) if frac else 0)
    if size > MAX_GPU_BYTES:
        raise UsageError(f"{option}: {_clip(text)} is more than 1 PiB, larger than any GPU")
    return size


def _clip(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...") + f" ({len(text):,} characters)"


def understood(text: str, size: int) -> str:
    """How a size was read, in both units: `96GB` is 89.41 GiB, which is not a 96 GB card's memory.total."""
    unit = "decimal (10^9)" if re.search(r"[kmgt]b\s*$", text.strip().lower()) else "binary (2^30)"
    return f"{text.strip()} read as {size:,} B = {size / GIB:.2f} GiB ({unit} units)"


def preset(name: str) -> Gpu:
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise UsageError(f"--gpu: unknown GPU {name!r} (known: {', '.join(PRESETS)}; or give --gpu-mem SIZE "
                         "with --arch FAMILY)")
    return PRESETS[key]


def local_gpu() -> Gpu | None:
    """The first visible CUDA device, when torch sees one (its total memory as the driver reports it)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    try:
        family: str | None = family_name(f"{props.major}{props.minor}")
    except UsageError:
        family = None
    return Gpu("local", f"{props.name} (device 0)", int(props.total_memory), family)


def choose_gpu(name: str | None, mem: str | None, arch: str | None = None) -> Gpu:
    """--gpu NAME, or --gpu-mem SIZE with --arch, or the local GPU; the family must be known (a usage error
    asks for it), since the engine picks its KV layout from it."""
    if name is not None and mem is not None:
        raise UsageError("--gpu and --gpu-mem are exclusive: give one")
    family = family_name(arch) if arch is not None else None
    if name is not None:
        gpu = preset(name)
        if family is not None and family != gpu.family:
            raise UsageError(f"--arch {arch}: the {gpu.description} is {gpu.family}")
        return gpu
    if mem is not None:
        size = parse_size(mem)
        if family is None:
            raise UsageError(f"--gpu-mem {mem.strip()}: which GPU family? The engine picks its KV layout from it: "
                             f"add --arch sm_90 (H100/H200), sm_100 (B200) or sm_120 (RTX PRO 6000), or give "
                             f"--gpu NAME ({', '.join(PRESETS)})")
        return Gpu("custom", f"{family} GPU, {understood(mem, size)}", size, family)
    found = local_gpu()
    if found is None:
        raise UsageError(f"no GPU visible here: give --gpu NAME ({', '.join(PRESETS)}) or --gpu-mem SIZE with "
                         "--arch FAMILY")
    if family is not None:
        found = found._replace(family=family)
    if found.family is None:
        raise UsageError(f"the local GPU ({found.description}) is of no family fit models: give --arch FAMILY")
    return found
