"""What each GPU arch lets one kernel launch hold: the resource table the launch plan is checked against.

At run time the plan takes the device's own limits (`device_limits`: torch's view of cudaDeviceProp); without
a device (`trellis bench --compile-only --arch X`, the CPU tests) it takes the arch's row of ARCH_TABLE.
The table's source is the CUDA C++ Programming Guide's table of technical specifications per compute
capability, cross-checked against the toolkit's `cuda::arch_traits` (docs/kernel.md, "Resources per arch").

TRELLIS_PLAN_LIMITS=sm_XY (a test-only override, docs/kernel.md) makes the plan use that arch's row on any
device, so that a plan sized for a smaller GPU can be run and checked on a larger one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from trellis_cli.errors import GpuUnavailable, UsageError

KB = 1024
PLAN_LIMITS_ENV = "TRELLIS_PLAN_LIMITS"


@dataclass(frozen=True)
class ArchLimits:
    arch: str  # "sm_120"
    smem_per_block_optin: int  # bytes one CTA may hold, static + dynamic, after cudaFuncSetAttribute
    smem_per_sm: int  # bytes all resident CTAs of an SM hold together, each with its reserved bytes
    reserved_smem_per_block: int  # bytes the system keeps per resident CTA
    registers_per_sm: int  # 32-bit registers
    max_registers_per_thread: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    wgmma: bool  # Hopper's warpgroup MMA (sm_90a only: sm_100 has tcgen05, sm_12x neither)
    source: str = "table"  # "table", "device" or "override"

    def describe(self) -> str:
        return (f"{self.arch}: {self.smem_per_block_optin // KB} KB shared memory per block, "
                f"{self.smem_per_sm // KB} KB per SM, {self.registers_per_sm // KB}K registers and "
                f"{self.max_threads_per_sm} threads per SM, {'wgmma' if self.wgmma else 'mma.sync only'}")


def _row(arch: str, smem_sm_kb: int, threads: int, blocks: int, wgmma: bool = False) -> ArchLimits:
    # Every arch here: 64K registers per SM, at most 255 per thread, 1 KB reserved per CTA, and a CTA may opt
    # in to all of the SM's shared memory but that reserved KB.
    return ArchLimits(arch, (smem_sm_kb - 1) * KB, smem_sm_kb * KB, KB, 64 * KB, 255, threads, blocks, wgmma)


# The archs the kernel builds for (docs/kernel.md "Resources per arch" gives the source of every number).
ARCH_TABLE: dict[str, ArchLimits] = {row.arch: row for row in (
    _row("sm_80", 164, 2048, 32),   # A100
    _row("sm_86", 100, 1536, 16),   # RTX 30xx, A40, A10
    _row("sm_89", 100, 1536, 24),   # RTX 40xx, L40S, L4
    _row("sm_90", 228, 2048, 32, wgmma=True),  # H100, H200
    _row("sm_100", 228, 2048, 32),  # B200, GB200
    _row("sm_120", 100, 1536, 24),  # RTX PRO 6000 Blackwell, RTX 50xx
    _row("sm_121", 100, 1536, 24),  # GB10 (DGX Spark)
)}


def limits_for_arch(arch: str) -> ArchLimits:
    """The table's row for `arch` ('sm_120' or '120'); GpuUnavailable for an arch it lacks."""
    from trellis_cli.kernel.nvcc import normalize_arch

    name = normalize_arch(arch)
    if name not in ARCH_TABLE:
        raise GpuUnavailable(f"GPU arch {name}: no resource limits known for it (known: {', '.join(ARCH_TABLE)})")
    return ARCH_TABLE[name]


def override_limits() -> ArchLimits | None:
    """The row named by TRELLIS_PLAN_LIMITS (test-only), or None when it is unset."""
    text = os.environ.get(PLAN_LIMITS_ENV, "").strip()
    if not text:
        return None
    try:
        return replace(limits_for_arch(text), source="override")
    except GpuUnavailable as err:
        raise UsageError(f"{PLAN_LIMITS_ENV}={text!r}: {err}") from None


def device_limits(device: int | None = None) -> ArchLimits:
    """The current (or given) CUDA device's own limits, read from its properties; the override when set. A
    property torch does not expose is taken from the table's row for the device's arch."""
    forced = override_limits()
    if forced is not None:
        return forced
    import torch

    from trellis_cli.kernel.nvcc import normalize_arch

    if not torch.cuda.is_available():
        raise GpuUnavailable("no CUDA device visible: pass --arch to plan without a GPU")
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    arch = normalize_arch(f"{props.major}{props.minor}")  # exit 4 naming the arch when older than sm_80
    row = ARCH_TABLE.get(arch) or _row(arch, 100, 1536, 16)  # an arch newer than the table: the smallest row

    def read(name: str, default: int) -> int:
        value = getattr(props, name, None)
        return int(value) if isinstance(value, int) and value > 0 else default

    return ArchLimits(
        arch=arch,
        smem_per_block_optin=read("shared_memory_per_block_optin", row.smem_per_block_optin),
        smem_per_sm=read("shared_memory_per_multiprocessor", row.smem_per_sm),
        reserved_smem_per_block=row.reserved_smem_per_block,
        registers_per_sm=read("regs_per_multiprocessor", row.registers_per_sm),
        max_registers_per_thread=row.max_registers_per_thread,
        max_threads_per_sm=read("max_threads_per_multi_processor", row.max_threads_per_sm),
        max_blocks_per_sm=row.max_blocks_per_sm,
        wgmma=row.wgmma,
        source="device",
    )
