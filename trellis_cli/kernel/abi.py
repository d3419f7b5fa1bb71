"""ctypes mirror of kernels/abi.h and loading of the compiled library.

`TrellisMoeArgs` must match the C struct field for field; the library reports its ABI version and
sizeof(TrellisMoeArgs), and `load_library` refuses a library whose numbers differ from this module's.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from trellis_cli.errors import GpuUnavailable

ABI_VERSION = 5
MAX_TIERS = 8

DT_FP32, DT_FP16, DT_BF16 = 0, 1, 2
SKIP_FC1, SKIP_ACT, SKIP_FC2, SKIP_SUM, SKIP_ROTATE, NO_PDL = 1, 2, 4, 8, 16, 32
FC2_WIDE_SPAN = 64  # FC2 CTAs of small tiles walk the most output blocks allowed (kernels/abi.h); same results
WGMMA_NARROW, WGMMA_WIDE = 256, 512  # 128-row tiles on Hopper: force the narrow or the wide kernels; same results

_POINTERS = (
    "global_to_combined",
    "descriptors",
    "rot_intermediate",
    "gate_suh",
    "up_suh",
    "down_svh",
    "x",
    "topk_ids",
    "topk_weights",
    "out",
    "tile_count",
    "tile_expert",
    "tile_start",
    "tile_rows",
    "slot_route",
    "partial",
    "xrot",
    "act",
    "route_out",
    "handover",
)
_SCALARS = (
    "abi_version",
    "num_tiers",
    "hidden",
    "intermediate",
    "num_experts",
    "num_combined",
    "codebook",
    "gate_suh_shared",
    "up_suh_shared",
    "down_svh_shared",
    "m",
    "top_k",
    "ids_int64",
    "x_dtype",
    "out_dtype",
    "m_tile",
    "k_split",
    "slot_capacity",
    "tile_capacity",
    "debug_flags",
    "direct",
    "fc1_tail_split",
)


class TrellisMoeArgs(ctypes.Structure):
    _fields_ = (
        [("tier_trellis", ctypes.c_void_p * MAX_TIERS)]
        + [(name, ctypes.c_void_p) for name in _POINTERS]
        + [("tier_k", ctypes.c_int32 * MAX_TIERS), ("tier_size", ctypes.c_int32 * MAX_TIERS)]
        + [(name, ctypes.c_int32) for name in _SCALARS]
    )


@dataclass
class KernelLibrary:
    """A loaded kernel library and where it came from."""

    handle: ctypes.CDLL
    path: Path
    build_hash: str
    arch: str
    nvcc_version: str
    wgmma: bool = False  # large tiles run on Hopper wgmma (kernels/expert_wgmma.cuh)
    codebook: str = ""  # the codebook whose kernels the library holds ("" when not known)

    def forward(self, args: TrellisMoeArgs, stream: int) -> tuple[int, str]:
        rc = int(self.handle.trellis_moe_forward(ctypes.byref(args), ctypes.c_void_p(stream)))
        message = self.handle.trellis_last_error().decode(errors="replace") if rc else ""
        return rc, message


def load_library(path: Path, build_hash: str = "", arch: str = "", nvcc_version: str = "",
                 codebook: str = "") -> KernelLibrary:
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as err:
        raise GpuUnavailable(f"cannot load the kernel library {path}: {err}") from None
    handle.trellis_abi_version.restype = ctypes.c_int
    handle.trellis_args_size.restype = ctypes.c_int
    handle.trellis_last_error.restype = ctypes.c_char_p
    handle.trellis_moe_forward.restype = ctypes.c_int
    handle.trellis_moe_forward.argtypes = [ctypes.POINTER(TrellisMoeArgs), ctypes.c_void_p]
    version, size = handle.trellis_abi_version(), handle.trellis_args_size()
    if version != ABI_VERSION or size != ctypes.sizeof(TrellisMoeArgs):
        raise GpuUnavailable(
            f"kernel library {path}: ABI {version} with {size}-byte args, expected ABI {ABI_VERSION} with "
            f"{ctypes.sizeof(TrellisMoeArgs)}-byte args (stale build: delete it and rebuild)"
        )
    # Libraries built before the wgmma path lack the symbol: their large tiles use mma.sync.
    wgmma = hasattr(handle, "trellis_has_wgmma") and bool(handle.trellis_has_wgmma())
    return KernelLibrary(handle, Path(path), build_hash, arch, nvcc_version, wgmma, codebook)


_LOADED: dict[str, KernelLibrary] = {}


def default_library(codebook: str = "mcg", *, jobs: int | None = None, log=None) -> KernelLibrary:
    """The library of `codebook` for the current GPU, built on first use and loaded once per process."""
    from trellis_cli.kernel.build import build_library

    built = build_library(codebook=codebook, jobs=jobs, log=log)
    key = str(built.path)
    if key not in _LOADED:
        _LOADED[key] = load_library(built.path, built.build_hash, built.arch, built.nvcc_version, built.codebook)
    return _LOADED[key]
