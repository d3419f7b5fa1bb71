"""ctypes mirror of kernels/abi.h and loading of the compiled library.

`TrellisMoeArgs` must match the C struct field for field; the library reports its ABI version and
sizeof(TrellisMoeArgs), and `load_library` refuses a library whose numbers differ from this module's,
and a lab build (lab/kernel/lab.py loads those).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from trellis_cli.errors import GpuUnavailable

ABI_VERSION = 6
MAX_TIERS = 8

DT_FP32, DT_FP16, DT_BF16 = 0, 1, 2

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
    "direct",
    "fc1_tail_split",
)


ARGS_FIELDS = (
    [("tier_trellis", ctypes.c_void_p * MAX_TIERS)]
    + [(name, ctypes.c_void_p) for name in _POINTERS]
    + [("tier_k", ctypes.c_int32 * MAX_TIERS), ("tier_size", ctypes.c_int32 * MAX_TIERS)]
    + [(name, ctypes.c_int32) for name in _SCALARS]
)


class TrellisMoeArgs(ctypes.Structure):
    _fields_ = ARGS_FIELDS


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
    kernels: str = "all"  # its K-sets: "all", or "k3k4" for layers whose tiers are all K3 or K4 (build.KERNEL_SETS)
    args_type: type[ctypes.Structure] = TrellisMoeArgs  # a lab build's arguments end with lab flags

    @property
    def lab(self) -> bool:
        return self.args_type is not TrellisMoeArgs

    def forward(self, args: ctypes.Structure, stream: int) -> tuple[int, str]:
        rc = int(self.handle.trellis_moe_forward(ctypes.byref(args), ctypes.c_void_p(stream)))
        message = self.handle.trellis_last_error().decode(errors="replace") if rc else ""
        return rc, message


def load_library(path: Path, build_hash: str = "", arch: str = "", nvcc_version: str = "",
                 codebook: str = "", kernels: str = "all") -> KernelLibrary:
    """The production library at `path`; a lab build is refused."""
    handle = open_library(path, TrellisMoeArgs, lab=False)
    return KernelLibrary(handle, Path(path), build_hash, arch, nvcc_version, bool(handle.trellis_has_wgmma()),
                         codebook, kernels)


def open_library(path: Path, args_type: type[ctypes.Structure], *, lab: bool) -> ctypes.CDLL:
    """The library's handle, its entry points typed, once it is the build asked for (`lab` or production)
    and its ABI version and argument size match `args_type`."""
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as err:
        raise GpuUnavailable(f"cannot load the kernel library {path}: {err}") from None
    if hasattr(handle, "trellis_lab_build") != lab:
        raise GpuUnavailable(f"kernel library {path} is {'not ' if lab else ''}a lab build: "
                             f"{'abi.load_library' if lab else 'lab/kernel/lab.py'} loads it")
    try:
        for name in ("trellis_abi_version", "trellis_args_size", "trellis_has_wgmma", "trellis_moe_forward"):
            getattr(handle, name).restype = ctypes.c_int
        handle.trellis_last_error.restype = ctypes.c_char_p
    except AttributeError as err:
        raise GpuUnavailable(f"{path} is not a trellis kernel library: {err}") from None
    handle.trellis_moe_forward.argtypes = [ctypes.POINTER(args_type), ctypes.c_void_p]
    version, size = handle.trellis_abi_version(), handle.trellis_args_size()
    if version != ABI_VERSION or size != ctypes.sizeof(args_type):
        raise GpuUnavailable(
            f"kernel library {path}: ABI {version} with {size}-byte args, expected ABI {ABI_VERSION} with "
            f"{ctypes.sizeof(args_type)}-byte args (stale build: delete it and rebuild)"
        )
    return handle


_LOADED: dict[str, KernelLibrary] = {}


def default_library(codebook: str = "mcg", *, kernels: str = "all", jobs: int | None = None,
                    log=None) -> KernelLibrary:
    """The library of `codebook` and kernel set `kernels` for the current GPU, built on first use and loaded
    once per process."""
    from trellis_cli.kernel.build import build_library

    built = build_library(codebook=codebook, kernels=kernels, jobs=jobs, log=log)
    key = str(built.path)
    if key not in _LOADED:
        _LOADED[key] = load_library(built.path, built.build_hash, built.arch, built.nvcc_version, built.codebook,
                                    built.kernels)
    return _LOADED[key]
