"""The kernel lab: lab builds of the kernel library, loaded and launched with their flags.

For the tools in lab/perf/ and the GPU tests, never for the product. A lab build compiles the product's
kernels with the lab's hooks patched in (lab/kernel/sources.py: kernels/ + lab/kernel/cuda/hooks.patch +
lab/kernel/cuda/lab.h, timeline.cuh, single_tu.cu), through the product build's one hook
(build.BuildExtension), with -DTRELLIS_LAB: its arguments end with `lab_flags` and it exports
trellis_lab_build. Variants: "lab", every unit as the product has them; "timeline", one codebook's whole
library as one unit (single_tu.cu) with -DTRELLIS_TIMELINE too. The production loader (abi.load_library) refuses a lab
build and `load_lab_library` refuses a production one. The flags skip phases of a call (SKIP_*, NO_PDL:
timing variants, whose results are meaningless) or force a launch shape (FC2_WIDE_SPAN, WGMMA_*: the
results are unchanged). The timeline variant also stamps when each CTA of each phase starts, returns from
its wait and ends (lab/kernel/cuda/timeline.cuh), read with `read_timeline`.

    python3 -m lab.kernel.lab [--variant lab|timeline|production] [--arch sm_90] [--codebook mcg]
                              [--kernels all|k3k4] [--commands]

builds one library and prints its path; with --commands it prints the nvcc command lines of that build
instead (build.build_commands, the lines the build runs) and builds nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import shlex
import sys
from pathlib import Path

import torch

from trellis_cli.errors import EXIT_FINDINGS, EXIT_GPU, EXIT_USAGE, CheckFailed, GpuUnavailable, TrellisError, UsageError
from trellis_cli.kernel import abi, build
from trellis_cli.kernel.launch import FusedMoe
from trellis_cli.kernel.plan import LaunchPlan
from lab.kernel.sources import lab_source_dir

PRODUCTION = "production"
# lab/kernel/cuda/lab.h TRELLIS_LAB_*
SKIP_FC1, SKIP_ACT, SKIP_FC2, SKIP_SUM, SKIP_ROTATE, NO_PDL = 1, 2, 4, 8, 16, 32
FC2_WIDE_SPAN = 64  # FC2 CTAs of small tiles walk the most output blocks allowed
WGMMA_NARROW, WGMMA_WIDE = 256, 512  # 128-row tiles on Hopper: the narrow or the wide wgmma kernels
LAB_VARIANTS = ("lab", "timeline")
# lab/kernel/cuda/timeline.cuh: g_timeline[phase][cta][field], fields start, waited, end, SM, then 4 marks (ns).
TIMELINE_PHASES = ("pack", "rotate", "fc1", "act", "fc2", "sum")
TIMELINE_MAX_CTAS, TIMELINE_FIELDS = 16384, 8


def extension(variant: str) -> build.BuildExtension:
    """What the product build compiles for a lab variant (its sources staged on first use)."""
    if variant == "lab":
        return build.BuildExtension("lab", lab_source_dir(), ("-DTRELLIS_LAB",))
    if variant == "timeline":
        return build.BuildExtension("timeline", lab_source_dir(), ("-DTRELLIS_LAB", "-DTRELLIS_TIMELINE"),
                                    single_source="single_tu.cu")
    raise UsageError(f"unknown lab variant {variant!r}: expected one of {', '.join(LAB_VARIANTS)}")


class TrellisLabArgs(ctypes.Structure):
    """TrellisMoeArgs of a lab build: the production fields, then lab_flags (hooks.patch, abi.h)."""

    _fields_ = list(abi.ARGS_FIELDS) + [("lab_flags", ctypes.c_int32)]


def load_lab_library(path: Path, build_hash: str = "", arch: str = "", nvcc_version: str = "",
                     codebook: str = "") -> abi.KernelLibrary:
    """The lab build at `path`; a production library is refused."""
    handle = abi.open_library(path, TrellisLabArgs, lab=True)
    return abi.KernelLibrary(handle, Path(path), build_hash, arch, nvcc_version, bool(handle.trellis_has_wgmma()),
                             codebook, args_type=TrellisLabArgs)


def load_any(path: Path) -> abi.KernelLibrary:
    """A lab or a production library, whichever the file is: for tools that compare builds."""
    try:
        is_lab = hasattr(ctypes.CDLL(str(path)), "trellis_lab_build")
    except OSError as err:
        raise GpuUnavailable(f"cannot load the kernel library {path}: {err}") from None
    loader = load_lab_library if is_lab else abi.load_library
    return loader(Path(path), Path(path).stem)


_LOADED: dict[str, abi.KernelLibrary] = {}


def lab_library(codebook: str = "mcg", *, variant: str = "lab", arch: str | None = None, jobs: int | None = None,
                log=None) -> abi.KernelLibrary:
    """The lab build of `codebook` (variant "lab" or "timeline") for `arch` (default: the current GPU's),
    built on first use and loaded once per process."""
    if variant not in LAB_VARIANTS:
        raise CheckFailed(f"unknown lab variant {variant!r}: expected one of {', '.join(LAB_VARIANTS)}")
    built = build.build_library(arch, codebook, jobs=jobs, log=log, extension=extension(variant))
    if str(built.path) not in _LOADED:
        _LOADED[str(built.path)] = load_lab_library(built.path, built.build_hash, built.arch, built.nvcc_version,
                                                    built.codebook)
    return _LOADED[str(built.path)]


class LabMoe(FusedMoe):
    """FusedMoe whose calls take lab flags. On a production library (a tool comparing builds) it runs
    calls without flags and refuses any flag."""

    def __init__(self, pack, library: abi.KernelLibrary | None = None, device: torch.device | str | None = None):
        super().__init__(pack, library or lab_library(pack.codebook), device)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, lab_flags: int = 0,
                out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, tier: int | None = None,
                plan: LaunchPlan | None = None) -> torch.Tensor:
        if self.library.lab:
            return self._launch(x, topk_ids, topk_weights, out, out_dtype, tier, plan, lab_flags=lab_flags)
        if lab_flags:
            raise CheckFailed(f"lab flags {lab_flags} need a lab build; {self.library.path} is the production "
                              f"library (lab.kernel.lab.lab_library builds one)")
        return self._launch(x, topk_ids, topk_weights, out, out_dtype, tier, plan)


def read_timeline(library: abi.KernelLibrary) -> list[list[tuple[int, ...]]]:
    """Per phase, the rows of the CTAs that ran since the last read (timeline variant), and clear them."""
    reader = getattr(library.handle, "trellis_timeline_read", None)
    count = len(TIMELINE_PHASES) * TIMELINE_MAX_CTAS * TIMELINE_FIELDS
    buf = (ctypes.c_ulonglong * count)()
    if reader is None or reader(buf) != 0:
        raise GpuUnavailable(f"cannot read the timeline of {library.path}: build the timeline variant "
                             f"(lab_library(variant='timeline'))")
    phases = []
    for p in range(len(TIMELINE_PHASES)):
        rows = []
        for c in range(TIMELINE_MAX_CTAS):
            i = (p * TIMELINE_MAX_CTAS + c) * TIMELINE_FIELDS
            if buf[i]:
                rows.append(tuple(buf[i:i + TIMELINE_FIELDS]))
        phases.append(rows)
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m lab.kernel.lab", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="lab", choices=(PRODUCTION, *LAB_VARIANTS))
    parser.add_argument("--kernels", default="all", choices=tuple(build.KERNEL_SETS),
                        help="the K-sets (lab variant; the timeline unit holds every kernel)")
    parser.add_argument("--arch", default=None, help="e.g. sm_90 (default: the current GPU's)")
    parser.add_argument("--codebook", default="mcg")
    parser.add_argument("--commands", action="store_true", help="print the nvcc command lines, build nothing")
    args = parser.parse_args(argv)
    try:
        chosen = None if args.variant == PRODUCTION else extension(args.variant)
        if args.commands:
            arch = args.arch or build.device_arch()
            for command in build.build_commands(arch, args.codebook, nvcc=build.find_nvcc(), kernels=args.kernels,
                                                extension=chosen):
                print(shlex.join(command))
        else:
            print(build.build_library(args.arch, args.codebook, kernels=args.kernels, log=print,
                                      extension=chosen).path)
    except TrellisError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_GPU if isinstance(err, GpuUnavailable) else EXIT_USAGE if isinstance(err, UsageError) else EXIT_FINDINGS
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
