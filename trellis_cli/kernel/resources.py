"""What each kernel of a call holds on an SM, and whether that fits an arch (kernel/arch_limits.py).

Threads and dynamic shared memory are the kernels' own constants (the `*_smem_bytes` and `k*Threads` of
kernels/copy_pipeline.cuh, fc1.cuh, fc2.cuh and expert_wgmma.cuh), repeated here so that a plan can be
checked without a device; tests/kernel/test_kernel_resources.py compiles those headers and holds these twins to
them. Registers and static shared memory come from ptxas: the build asks nvcc for its resource usage
(`--resource-usage`, ptxas -v) and records it beside every object and library (`parse_ptxas`,
`read_record`). Without a record a kernel's registers are taken at its `__launch_bounds__` budget, the most
ptxas may give it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from trellis_cli.codebooks import IDS as CODEBOOK_IDS
from trellis_cli.kernel.arch_limits import KB, ArchLimits

FC1_THREADS, FC2_THREADS, WGMMA_THREADS = 512, 256, 512  # kFc1Threads, kFc2Threads (gemm_tile.cuh), kWgThreads
PACK_THREADS = 1024  # kPackThreads (route_pack.cuh)
WIDE_PACK_FROM = 4096  # kWidePackFrom: from this many routes the pack runs a CTA per 1024 routes
O_STRIDE = 132  # kOStride: floats per epilogue row
WG_PASS_ROWS, WG_FC2_BLOCKS, WG_FEATURES = 32, 4, 256  # kWgPassRows, kFc2BlocksPerCta, kWgFeatures
WG_WIDE_ROWS, WG_NARROW_ROWS = 128, 64  # kWgRows, kWgNarrowRows
ROWS_PER_FAMILY = {"mma16": 1, "mma32": 2, "mma128": 8}  # R: 16-row blocks per tile


def _max_k(fast: bool) -> int:
    return 4 if fast else 8


def _a_stride(r: int, kt: int = 8) -> int:
    """Halves per staged A row: kt k tiles of 16 columns (twice that expanded for small tiles) + 8."""
    return 16 * kt * (2 if r <= 2 else 1) + 8


DIRECT_ROW_HALVES = (2 * 48 + 1) * 256  # kDirectRowHalves (fc1.cuh): direct mode's resident rows


def fc1_chunk_tiles(r: int, fast: bool, compact: bool) -> int:
    """k tiles per staged FC1 chunk (gemm_tile.cuh fc1_chunk_tiles): libraries without wgmma (`compact`) stage
    the K3/K4 128-row and the all-K 16- and 32-row FC1 in chunks of 64 columns, the all-K 128-row FC1 in
    chunks of 32, so that they fit 99 KB."""
    if not compact:
        return 8
    return (4 if fast else 2) if r > 2 else (8 if fast else 4)


def fc2_chunk_tiles(r: int, fast: bool, compact: bool) -> int:
    """k tiles per staged FC2 chunk (gemm_tile.cuh fc2_chunk_tiles): 4 for the all-K 128-row FC2 of a library
    without wgmma, else 8."""
    return 4 if compact and r > 2 and not fast else 8


def fc1_smem_bytes(r: int, fast: bool, compact: bool = False) -> int:
    stages = 3 if r == 1 else 2
    kt = fc1_chunk_tiles(r, fast, compact)
    rows = stages * 2 * r * 16 * _a_stride(r, kt)
    if r == 1:
        rows = max(rows, DIRECT_ROW_HALVES)
    return stages * 2 * kt * 64 * _max_k(fast) * 4 + 2 * rows


def fc2_smem_bytes(r: int, fast: bool, compact: bool = False) -> int:
    kt = fc2_chunk_tiles(r, fast, compact)
    ring = (2 if fast else 3) * (kt * 64 * _max_k(fast) * 4 + r * 16 * _a_stride(r, kt) * 2)
    return max(ring, r * 16 * O_STRIDE * 4)


def wg_smem_bytes(fast: bool, rows: int) -> int:
    stages = 3 if fast and rows == WG_WIDE_ROWS else 2
    stage = 2 * 8 * 64 * _max_k(fast) * 4 + 2 * rows * 128
    return stages * stage + 2 * WG_PASS_ROWS * O_STRIDE * 4 + WG_WIDE_ROWS * 8 + WG_FC2_BLOCKS * WG_FEATURES * 2


@dataclass(frozen=True)
class KernelShape:
    """One kernel as a launch holds it: its name as ptxas reports it (demangled to the template), threads
    per CTA, dynamic shared memory and the CTAs per SM its __launch_bounds__ asks for."""

    name: str  # e.g. "fc1_kernel<mcg, R=1, K3/K4>"
    symbol: tuple[str, tuple[int, ...]]  # (function, template arguments) as in the object: ("fc1_kernel", (1, 1, 1))
    threads: int
    dynamic_smem: int
    min_blocks: int = 1

    @property
    def register_budget(self) -> int:
        """The most registers ptxas may give a thread under the launch bounds (64K per SM on every arch)."""
        return min(255, 64 * KB // (self.threads * self.min_blocks) // 8 * 8)


def gemm_kernels(codebook: str, family: str, fast: bool, narrow: bool = False,
                 compact: bool = False) -> tuple[KernelShape, KernelShape]:
    """FC1 and FC2 of one codebook, tile family ("mma16", "mma32", "mma128", "wgmma") and K-set; `compact`:
    as a library without wgmma builds them (its 128-row and all-K FC1 stage half chunks)."""
    cb, kset = CODEBOOK_IDS[codebook], "K3/K4" if fast else "all K"
    if family == "wgmma":
        rows = WG_NARROW_ROWS if narrow else WG_WIDE_ROWS
        smem, blocks = wg_smem_bytes(fast, rows), 2 if narrow else 1

        def wgmma(phase: str) -> KernelShape:
            return KernelShape(f"{phase}_wgmma_kernel<{codebook}, {kset}, {rows} rows>",
                               (f"{phase}_wgmma_kernel", (cb, int(fast), rows)), WGMMA_THREADS, smem, blocks)

        return wgmma("fc1"), wgmma("fc2")
    r = ROWS_PER_FAMILY[family]
    fc1 = KernelShape(f"fc1_kernel<{codebook}, {16 * r} rows, {kset}>", ("fc1_kernel", (cb, r, int(fast))),
                      FC1_THREADS, fc1_smem_bytes(r, fast, compact), 2 if r <= 2 and fast else 1)
    fc2 = KernelShape(f"fc2_kernel<{codebook}, {16 * r} rows, {kset}>", ("fc2_kernel", (cb, r, int(fast))),
                      FC2_THREADS, fc2_smem_bytes(r, fast, compact), (4 if r <= 2 else 2) if fast else 1)
    return fc1, fc2


def pack_kernel(routes: int, num_combined: int) -> KernelShape:
    """The route pack: one CTA with 3 ints per combined expert, or from WIDE_PACK_FROM routes the scatter
    kernel with 4 (the larger of its two kernels)."""
    if routes >= WIDE_PACK_FROM:
        return KernelShape("route_scatter_kernel", ("route_scatter_kernel", ()), PACK_THREADS, 16 * num_combined)
    return KernelShape("route_pack_kernel", ("route_pack_kernel", ()), PACK_THREADS, 12 * num_combined)


@dataclass(frozen=True)
class Usage:
    """ptxas's numbers for one kernel."""

    registers: int
    static_smem: int = 0


@dataclass(frozen=True)
class Misfit:
    """Why one kernel does not fit an arch: the limit, what it is, what the kernel asks."""

    kernel: str
    limit: str
    allowed: int
    needed: int

    def message(self, limits: ArchLimits) -> str:
        unit = " bytes" if "memory" in self.limit else ""
        return (f"{self.kernel} does not fit {limits.arch}: {self.limit} {self.needed}{unit}, the arch allows "
                f"{self.allowed}{unit} ({limits.source} limits)")


REGISTER_GRANULE = 8  # registers are allocated per thread in multiples of 8 (256 per warp)


def allocated_registers(registers: int) -> int:
    return -(-registers // REGISTER_GRANULE) * REGISTER_GRANULE


def misfit(kernel: KernelShape, limits: ArchLimits, usage: Usage | None = None) -> Misfit | None:
    """The first limit of `limits` that one CTA of `kernel` breaks, or None when it launches there."""
    registers = usage.registers if usage else kernel.register_budget
    smem = kernel.dynamic_smem + (usage.static_smem if usage else 0)
    checks = (
        ("shared memory per block (static + dynamic)", limits.smem_per_block_optin, smem),
        ("shared memory per SM (with the reserved bytes)", limits.smem_per_sm, smem + limits.reserved_smem_per_block),
        ("registers per thread", limits.max_registers_per_thread, registers),
        ("registers per CTA (as allocated)", limits.registers_per_sm, allocated_registers(registers) * kernel.threads),
        ("threads per CTA", limits.max_threads_per_sm, kernel.threads),
    )
    for limit, allowed, needed in checks:
        if needed > allowed:
            return Misfit(kernel.name, limit, allowed, needed)
    return None


# ---------------------------------------------------------------------------------------------------
# ptxas's record

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_MANGLED = re.compile(r"_ZN7trellis(\d+)")
_TEMPLATE_ARG = re.compile(r"L([ib])(\d+)E")


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """{mangled kernel name: {"registers": n, "static_smem": bytes}} from nvcc --resource-usage output."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        entry = _ENTRY.search(line) or _PROPERTIES.search(line)
        if entry:
            current = entry.group(1)
            kernels.setdefault(current, {"registers": 0, "static_smem": 0})
            continue
        if current is None:
            continue
        registers = _REGISTERS.search(line)
        if registers:
            kernels[current]["registers"] = int(registers.group(1))
            smem = _SMEM.search(line)
            if smem:
                kernels[current]["static_smem"] = int(smem.group(1))
    return kernels


def kernel_symbol(mangled: str) -> tuple[str, tuple[int, ...]] | None:
    """("fc1_kernel", (1, 1, 1)) for a mangled trellis:: kernel; None for anything else."""
    match = _MANGLED.match(mangled)
    if not match:
        return None
    length, start = int(match.group(1)), match.end()
    name, rest = mangled[start:start + length], mangled[start + length:]
    if not rest.startswith("I"):
        return name, ()
    args, depth, i = [], 1, 1
    while depth and i < len(rest):
        if rest[i] == "E":
            depth -= 1
            i += 1
            continue
        arg = _TEMPLATE_ARG.match(rest, i)
        if not arg:
            break
        args.append(int(arg.group(2)))
        i = arg.end()
    return name, tuple(args)


def record_path(built: Path) -> Path:
    """Where ptxas's numbers for an object or library are recorded: beside it, `<name>.resources.json`."""
    return built.with_name(f"{built.name}.resources.json")


def write_record(path: Path, arch: str, kernels: dict[str, dict[str, int]]) -> None:
    """The record of one object or library: its arch and each kernel's ptxas numbers (written atomically)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"arch": arch, "kernels": dict(sorted(kernels.items()))}, indent=1) + "\n")
    tmp.replace(path)


def read_raw_record(path: Path) -> dict[str, dict[str, int]]:
    """A record's kernels by mangled name; empty when the file is missing or unreadable."""
    try:
        kernels = json.loads(path.read_text())["kernels"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return kernels if isinstance(kernels, dict) else {}


def read_record(path: Path) -> dict[tuple[str, tuple[int, ...]], Usage]:
    """A record as {kernel symbol: Usage}; empty when the file is missing or unreadable."""
    usage: dict[tuple[str, tuple[int, ...]], Usage] = {}
    for mangled, numbers in read_raw_record(path).items():
        symbol = kernel_symbol(mangled)
        if symbol and isinstance(numbers, dict):
            usage[symbol] = Usage(int(numbers.get("registers", 0)), int(numbers.get("static_smem", 0)))
    return usage
