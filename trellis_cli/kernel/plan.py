"""Host-side launch plan, workspace sizes and the layout checks of the fused kernel.

A plan depends only on (M, top_k, pack geometry), never on the routes, so one plan serves every call of
a given M and a captured CUDA graph stays valid for any routes. The Python twins of the device's
algorithms, which the tests and the lab tools hold the kernel to, are in kernel/oracle.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis_cli.codebooks import NAMES as CODEBOOK_NAMES
from trellis_cli.errors import CheckFailed, GpuUnavailable
from trellis_cli.formats.layer_pack import MAX_TIER_EXPERTS, LayerPack
from trellis_cli.kernel.arch_limits import ArchLimits
from trellis_cli.kernel.resources import KernelShape, Usage, allocated_registers, gemm_kernels, misfit, pack_kernel

BLOCK_ROWS = 16  # each expert's slot segment is padded to one MMA m16 block
SMALL_TILE, MID_TILE, LARGE_TILE = 16, 32, 128
# Routes per expert from which 32-row and 128-row tiles win (choose_m_tile).
MID_FROM = 14
LARGE_FROM_MMA_SYNC, LARGE_FROM_WGMMA = 64, 11
# The compact K3/K4 128-row kernels of a library without wgmma (one CTA of 16 warps per SM within 99 KB) against
# its 32-row tiles, glm52-tp4 under sm_120's limits on an H100, fused us 32 / 128 rows: M=1024 (32 routes per
# expert) 1871 / 2186, M=1536 (48) 2846 / 2436 (docs/perf-log/2026-12-07-sm120-large-m.md).
LARGE_FROM_COMPACT = 40
# The wgmma large-tile kernels take 256 features per CTA (kernels/expert_wgmma.cuh kWgFeatures): other
# shapes run their 128-row tiles on mma.sync.
WGMMA_FEATURES = 256
HADAMARD = 128
MAX_TIERS = 8
# Enough FC1 work items to keep every SM of a large GPU busy at small M (glm52-tp4 on H200: M=16 ran
# 7 % faster with 2-3 H ranges than with 1; M=8 and M=32..64 are flat from 1 to 4).
TARGET_FC1_CTAS = 1100
# Each FC1 CTA walks at least this many 128-wide chunks of H: shorter runs pay their pipeline fill and
# launch tail too often (glm52-tp4 M=1, measured: 8 ranges of 6 chunks 52.8 us, 24 ranges of 2 63.1 us).
MIN_FC1_CHUNKS = 6
# Direct mode (kernels/abi.h): up to this many routes each get their own one-row tile, with no route pack
# and no rotation launch. Top-k ids of one token are distinct, so at M=1 no expert is decoded twice.
# From 7 tokens an expert shared by two of them is decoded once per route, and the pack wins (glm52-tp4
# on H200, direct / packed us: M=6 151.0 / 162.5, M=7 184.0 / 174.0).
DIRECT_MAX_ROUTES = 48
DIRECT_MAX_CHUNKS = 48  # kDirectMaxChunks: FC1's resident input rows must fit its A ring
# FC1 CTAs wanted in direct mode (glm52-tp4 on H200, us by H ranges: M=1 8: 43.1, 4: 43.6, 12: 47.8;
# M=2 4: 71.4, 6: 72.0, 8: 73.8; M=3 3: 113.6, 4: 100.5, 8: 103.2).
DIRECT_FC1_CTAS = 384
# FC1 cuts the H ranges of its last half wave of items in 4 or 2 pieces (kernels/fc1_split.cuh) where the
# ranges hold at least this many chunks and each piece keeps at least MIN_FC1_CHUNKS: shorter ranges end
# their wave soon anyway (M=8's 12-chunk ranges lost 1 % cut in 2 or 4).
FC1_TAIL_FROM_CHUNKS = 24
# 128-row tiles on Hopper take the tail where their experts average fewer routes than this: the narrow wgmma
# kernels (two CTAs per SM) run below 52 (kernels/tile_kernels.cuh kNarrowBelowRoutes), and the tail bought
# -1.5 % at 16-24 routes (glm52-tp4 M = 512-768), nothing at 32 and cost 1.8 % at 39.
FC1_TAIL_LARGE_BELOW_ROUTES = 32
# K3/K4 layers whose experts average fewer routes than this run the narrow wgmma kernels
# (kernels/tile_kernels.cuh kNarrowBelowRoutes).
WGMMA_NARROW_BELOW_ROUTES = 52


class KernelDoesNotFit(GpuUnavailable):
    """No plan's kernels fit the arch's limits (exit 4): the message names the arch, the limit and the kernel."""


def kernel_set(pack: LayerPack) -> str:
    """The library kernel set (kernel/build.py KERNEL_SETS) that serves the pack: "k3k4" where every tier
    holding experts is K3 or K4, else "all"."""
    from trellis_cli.kernel.build import kernels_for

    return kernels_for(k for k, size in zip(pack.tier_k, pack.tier_size) if size)


@dataclass(frozen=True)
class LaunchPlan:
    m: int
    top_k: int
    m_tile: int
    k_split: int
    slot_capacity: int
    tile_capacity: int
    direct: bool = False
    fc1_tail_split: int = 1  # the partial sums hold k_split * fc1_tail_split planes
    family: str = ""  # the GEMM kernels' tile family: "mma16", "mma32", "mma128" or "wgmma" (narrow or wide)

    def describe(self) -> str:
        mode = "direct" if self.direct else "packed"
        return (f"{mode}, {self.m_tile}-row tiles on {self.family or 'the default kernels'}, k_split {self.k_split}"
                f"{f' (tail x{self.fc1_tail_split})' if self.fc1_tail_split > 1 else ''}")


def slot_capacity(numel: int, num_combined: int) -> int:
    """Padded slots in the worst case: every non-empty expert pads its segment by up to 15 rows."""
    return numel + (BLOCK_ROWS - 1) * min(numel, num_combined)


def tile_capacity(numel: int, m_tile: int, num_combined: int) -> int:
    return numel // m_tile + min(numel, num_combined)


def routes_per_expert(numel: int, num_experts: int) -> float:
    """Routes each served expert expects under uniform routing: numel / E for the layer's E experts, however
    many of them this rank serves (under expert parallelism a rank sees numel * E_c / E of the routes, over
    its E_c experts). The kernel decides between its narrow and wide wgmma kernels on the same measure
    (kernels/tile_kernels.cuh narrow_wgmma_tiles)."""
    return numel / max(1, num_experts)


def choose_m_tile(numel: int, num_experts: int, wgmma: bool = False, compact_fast: bool = False) -> int:
    # A work tile decodes its expert's weights once for all its rows, so an expert with more routes than
    # one tile holds is decoded again per tile. Mid tiles (split words, like small ones) hold most experts
    # in one tile from about 14 routes per expert on (glm52-tp4, 16 / 32 rows: M=384 1023 / 1121 us,
    # M=512 1302 / 1188); large tiles (merged weights, 128 rows) win from about 64 on mma.sync, and on
    # Hopper wgmma, whose MMA N follows the tile's routes and whose narrow kernels run two CTAs per SM, from
    # 11 (16 / 128 rows: M=320 879 / 904 us, M=352 926 / 903, M=384 989 / 924).
    # compact_fast: the compact K3/K4 kernels of a library without wgmma (LARGE_FROM_COMPACT).
    per_expert = routes_per_expert(numel, num_experts)
    large_from = LARGE_FROM_WGMMA if wgmma else LARGE_FROM_COMPACT if compact_fast else LARGE_FROM_MMA_SYNC
    if per_expert >= large_from:
        return LARGE_TILE
    return MID_TILE if per_expert >= MID_FROM else SMALL_TILE


def choose_k_split(m_tile: int, tiles: int, hidden: int, intermediate: int, target: int = TARGET_FC1_CTAS) -> int:
    chunks = hidden // HADAMARD
    wanted = max(1, target // max(1, tiles * (intermediate // HADAMARD)))
    wanted = max(1, min(wanted, chunks // MIN_FC1_CHUNKS))
    while chunks % wanted:
        wanted -= 1
    return wanted


def make_plan(m: int, top_k: int, hidden: int, intermediate: int, num_combined: int,
              m_tile: int | None = None, k_split: int | None = None, direct: bool | None = None,
              wgmma: bool = False, num_experts: int | None = None, *, limits: ArchLimits | None = None,
              codebook: str = "mcg", fast: bool = True,
              usage: dict[tuple[str, tuple[int, ...]], Usage] | None = None) -> LaunchPlan:
    """num_combined: the experts this pack serves (E_c, which bounds the workspace); num_experts: the
    layer's E (len(global_to_combined); E_c when omitted), which sets the expected routes per expert.

    With `limits` (kernel/arch_limits.py) every kernel of the plan fits that arch: a tile family whose FC1 or
    FC2 does not (shared memory, registers from ptxas's `usage` record, threads) gives way to the next smaller
    tile, and where none fits, or the `m_tile` asked for does not, KernelDoesNotFit names the arch, the limit
    and the kernel. `codebook` and `fast` (every served tier K3 or K4) name the kernels the call runs; a library
    without wgmma (`wgmma` false, as asked, before the arch's limits) holds the compact FC1 kernels
    (resources.fc1_chunk_tiles)."""
    numel = m * top_k
    num_experts = num_experts or num_combined
    chunks = hidden // HADAMARD
    compact = not wgmma
    if limits is not None:
        wgmma = wgmma and limits.wgmma
        _check_fits(pack_kernel(numel, num_combined), limits, usage)
    if direct is None:
        direct = numel <= DIRECT_MAX_ROUTES and m_tile in (None, SMALL_TILE)
    if direct:
        if limits is not None:
            _check_fits_family(SMALL_TILE, numel, num_experts, False, limits, codebook, fast, usage, compact)
        split = k_split or choose_k_split(SMALL_TILE, numel, hidden, intermediate, DIRECT_FC1_CTAS)
        while not k_split and (chunks // split > DIRECT_MAX_CHUNKS or chunks % split):
            split += 1
        if chunks % split or chunks // split > DIRECT_MAX_CHUNKS:
            raise CheckFailed(f"k_split {split} must divide hidden/128 = {chunks} into ranges of at most "
                              f"{DIRECT_MAX_CHUNKS} chunks (direct mode)")
        return LaunchPlan(m, top_k, SMALL_TILE, split, numel, numel, direct=True, family="mma16")
    wgmma = wgmma and hidden % WGMMA_FEATURES == 0 and intermediate % WGMMA_FEATURES == 0
    tile = m_tile or choose_m_tile(numel, num_experts, wgmma, compact and fast)
    if limits is not None:
        tile = _fitting_tile(tile, m_tile is not None, numel, num_experts, wgmma, limits, codebook, fast, usage,
                             compact)
    tiles = tile_capacity(numel, tile, num_combined)
    # Expected busy tiles: distinct experts touched, plus one extra tile per m_tile routes (of the routes
    # this pack serves).
    served = numel * min(num_combined, num_experts) // num_experts
    expected = min(served, num_combined) + served // tile
    split = k_split or choose_k_split(tile, expected, hidden, intermediate)
    if chunks % split:
        raise CheckFailed(f"k_split {split} must divide hidden/128 = {chunks}")
    pair = limits is None or _two_per_sm(
        plan_kernels(tile, numel, num_experts, wgmma, codebook, fast, compact)[0], limits, usage)
    tail = choose_fc1_tail_split(tile, chunks // split, numel, num_experts, wgmma, pair)
    return LaunchPlan(m, top_k, tile, split, slot_capacity(numel, num_combined), tiles, fc1_tail_split=tail,
                      family=tile_family(tile, wgmma))


def tile_family(m_tile: int, wgmma: bool) -> str:
    """The GEMM kernels that serve tiles of `m_tile` rows (kernels/trellis_moe.cu tile_family); `wgmma`: the
    library has them and the layer's H and I suit them."""
    return "wgmma" if m_tile == LARGE_TILE and wgmma else f"mma{m_tile}"


def plan_kernels(m_tile: int, numel: int, num_experts: int, wgmma: bool, codebook: str,
                 fast: bool, compact: bool = False) -> tuple[KernelShape, KernelShape]:
    """FC1 and FC2 as a call with these tiles launches them (the narrow wgmma kernels below
    WGMMA_NARROW_BELOW_ROUTES routes per expert on K3/K4 layers, kernels/tile_kernels.cuh); `compact`: a
    library built without wgmma."""
    family = tile_family(m_tile, wgmma)
    narrow = family == "wgmma" and fast and numel < WGMMA_NARROW_BELOW_ROUTES * max(1, num_experts)
    return gemm_kernels(codebook, family, fast, narrow, compact)


def _check_fits(kernel: KernelShape, limits: ArchLimits,
                usage: dict[tuple[str, tuple[int, ...]], Usage] | None) -> None:
    found = misfit(kernel, limits, (usage or {}).get(kernel.symbol))
    if found:
        raise KernelDoesNotFit(found.message(limits))


def _two_per_sm(kernel: KernelShape, limits: ArchLimits,
                usage: dict[tuple[str, tuple[int, ...]], Usage] | None) -> bool:
    """Whether two CTAs of `kernel` fit one SM of `limits` (shared memory with the reserved bytes, registers
    as allocated, threads)."""
    found = (usage or {}).get(kernel.symbol)
    registers = found.registers if found else kernel.register_budget
    smem = kernel.dynamic_smem + (found.static_smem if found else 0) + limits.reserved_smem_per_block
    return (2 * smem <= limits.smem_per_sm and 2 * kernel.threads <= limits.max_threads_per_sm
            and 2 * allocated_registers(registers) * kernel.threads <= limits.registers_per_sm)


def _check_fits_family(m_tile: int, numel: int, num_experts: int, wgmma: bool, limits: ArchLimits, codebook: str,
                       fast: bool, usage: dict[tuple[str, tuple[int, ...]], Usage] | None,
                       compact: bool = False) -> None:
    for kernel in plan_kernels(m_tile, numel, num_experts, wgmma, codebook, fast, compact):
        _check_fits(kernel, limits, usage)


def _fitting_tile(tile: int, forced: bool, numel: int, num_experts: int, wgmma: bool, limits: ArchLimits,
                  codebook: str, fast: bool, usage: dict[tuple[str, tuple[int, ...]], Usage] | None,
                  compact: bool = False) -> int:
    """`tile`, or the largest smaller tile whose kernels fit `limits` (a forced tile must fit as it is)."""
    candidates = [tile] if forced else [t for t in (LARGE_TILE, MID_TILE, SMALL_TILE) if t <= tile]
    refusal = ""
    for candidate in candidates:
        try:
            _check_fits_family(candidate, numel, num_experts, wgmma, limits, codebook, fast, usage, compact)
            return candidate
        except KernelDoesNotFit as err:
            refusal = str(err)
    raise KernelDoesNotFit(f"no launch plan fits {limits.arch}: {refusal}")


def choose_fc1_tail_split(m_tile: int, range_chunks: int, numel: int, num_experts: int, wgmma: bool,
                          pair_fits: bool = True) -> int:
    """How many times finer FC1 cuts the H ranges of its last half wave of items: where two of its CTAs
    share an SM (small and mid tiles; 128-row tiles on the narrow wgmma kernels, below
    FC1_TAIL_LARGE_BELOW_ROUTES) and the ranges hold at least FC1_TAIL_FROM_CHUNKS chunks, the largest of 4
    and 2 that leaves MIN_FC1_CHUNKS per piece, else 1. The kernel takes whole ranges where one CTA fills
    an SM, and so where the arch has room for one only (`pair_fits` false: the small and mid FC1 hold
    98-99 KB, one per SM on the 100 KB archs). (glm52-tp4 on H200: M = 16-256 -2 to -5 %, M = 512-768
    -1.5 %; under sm_120's limits on an H100, 32-row tiles at M=512: whole ranges 1095 us, tail x4 1123.)"""
    narrow = wgmma and routes_per_expert(numel, num_experts) < FC1_TAIL_LARGE_BELOW_ROUTES
    two_per_sm = (m_tile <= MID_TILE or narrow) and pair_fits
    if not two_per_sm or range_chunks < FC1_TAIL_FROM_CHUNKS:
        return 1
    for split in (4, 2):
        if range_chunks % split == 0 and range_chunks // split >= MIN_FC1_CHUNKS:
            return split
    return 1


def activation_expand(plan: LaunchPlan) -> int:
    """2 when the GEMM inputs (xrot, act) hold every column twice: small and mid tiles multiply split
    codebook words (kernels/decode.cuh), large tiles merged weights against plain rows."""
    return 2 if plan.m_tile <= MID_TILE else 1


def workspace_shapes(plan: LaunchPlan, hidden: int, intermediate: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    slots = max(1, plan.slot_capacity)
    tiles = max(1, plan.tile_capacity)
    expand = activation_expand(plan)
    return {
        "tile_count": ((1,), torch.int32),
        "tile_expert": ((tiles,), torch.int32),
        "tile_start": ((tiles,), torch.int32),
        "tile_rows": ((tiles,), torch.int32),
        "slot_route": ((slots,), torch.int32),
        "partial": ((plan.k_split * plan.fc1_tail_split, slots, 2 * intermediate), torch.float32),
        "xrot": ((slots, 2, expand * hidden), torch.float16),
        "act": ((slots, expand * intermediate), torch.float16),
        "route_out": ((max(1, plan.m * plan.top_k), hidden), torch.float32),
        "handover": ((3, tiles), torch.int32),
    }


# ---------------------------------------------------------------------------------------------------
# What the kernel assumes about a LayerPack


def check_pack_layout(pack: LayerPack) -> None:
    """Raise CheckFailed when the pack's tensors differ from what the kernel reads (formats/layer_pack.py)."""
    hidden, inter = pack.hidden, pack.intermediate
    if hidden % HADAMARD or inter % HADAMARD or hidden <= 0 or inter <= 0:
        raise CheckFailed(f"layer pack: hidden {hidden} and intermediate {inter} must be multiples of 128")
    if inter > 32 * HADAMARD:
        raise CheckFailed(f"layer pack: intermediate per rank {inter} exceeds the kernel's 4096")
    if not 1 <= len(pack.tier_trellis) <= MAX_TIERS or len(pack.tier_k) != len(pack.tier_trellis):
        raise CheckFailed(f"layer pack: expected 1..{MAX_TIERS} tiers with one K each, found "
                          f"{len(pack.tier_trellis)} trellis tensors and tier_k {pack.tier_k}")
    tiles = (hidden // 16) * (inter // 16)
    for t, (trellis, k) in enumerate(zip(pack.tier_trellis, pack.tier_k)):
        want = [int(trellis.shape[0]) if trellis.dim() else -1, 3, tiles, 16 * k]
        if trellis.dtype != torch.int16 or list(trellis.shape) != want or not 1 <= k <= 8:
            raise CheckFailed(f"tier{t}.trellis: expected int16 {want} with K in 1..8, found "
                              f"{trellis.dtype} {list(trellis.shape)} (K={k})")
        if int(trellis.shape[0]) > MAX_TIER_EXPERTS:
            raise CheckFailed(f"tier{t}.trellis: {trellis.shape[0]} experts, at most {MAX_TIER_EXPERTS}")
    combined = pack.num_combined
    _expect(pack.global_to_combined, torch.int32, None, "global_to_combined")
    _expect(pack.descriptors, torch.int32, [combined], "descriptors")
    _expect(pack.rot_intermediate, torch.float16, [combined, 3, inter], "rot.intermediate")
    for name, table in (("rot.gate_suh", pack.gate_suh), ("rot.up_suh", pack.up_suh), ("rot.down_svh", pack.down_svh)):
        rows = int(table.shape[0]) if table.dim() == 2 else -1
        _expect(table, torch.float16, [rows if rows in (1, combined) else combined, hidden], name)
    if pack.codebook not in CODEBOOK_NAMES:
        raise CheckFailed(f"layer pack: unknown codebook {pack.codebook!r}")


def _expect(tensor: torch.Tensor, dtype: torch.dtype, shape: list[int] | None, name: str) -> None:
    ok = tensor.dtype == dtype and (tensor.dim() == 1 if shape is None else list(tensor.shape) == shape)
    if not ok:
        want = "[E]" if shape is None else str(shape)
        raise CheckFailed(f"{name}: expected {dtype} {want}, found {tensor.dtype} {list(tensor.shape)}")
