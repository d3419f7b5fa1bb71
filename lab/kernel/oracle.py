"""Python twins of what the fused kernel computes on the device, for the tests and the lab tools.

Not used by the product: the route pack as kernels/route_pack.cuh builds it (count, padded prefix, tile
list, scatter in route order), and the expanded column layout of the GEMM inputs undone
(kernels/decode.cuh expanded_col). The CPU tests check the algorithm's invariants against these; the
stage-by-stage tool (lab/perf/kernel_stages.py) reads a call's workspace through them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis_cli.kernel.plan import BLOCK_ROWS
from trellis_cli.formats.layer_pack import LayerPack, split_descriptor


@dataclass
class RoutePack:
    counts: list[int]  # routes per combined expert
    slot_base: list[int]  # first slot of each expert's segment
    tiles: list[tuple[int, int, int]]  # (combined expert, first slot, rows)
    slot_route: dict[int, int]  # slot -> route id (padding slots absent)


def route_combined(expert: int, global_to_combined: list[int], descriptors: list[int], tier_size: list[int]) -> int:
    if not 0 <= expert < len(global_to_combined):
        return -1
    combined = global_to_combined[expert]
    if not 0 <= combined < len(descriptors) or descriptors[combined] < 0:
        return -1
    tier, local = split_descriptor(descriptors[combined])
    if tier >= len(tier_size) or local >= tier_size[tier]:
        return -1
    return combined


def route_pack_reference(topk_ids: torch.Tensor, pack: LayerPack, m_tile: int) -> RoutePack:
    """Count, padded prefix, tile list and scatter, in the device's order (scatter in route order)."""
    g2c = [int(v) for v in pack.global_to_combined.tolist()]
    desc = [int(v) for v in pack.descriptors.tolist()]
    sizes = pack.tier_size
    routes = [route_combined(int(e), g2c, desc, sizes) for e in topk_ids.reshape(-1).tolist()]
    counts = [0] * len(desc)
    for combined in routes:
        if combined >= 0:
            counts[combined] += 1
    slot_base, tiles, run = [], [], 0
    for combined, count in enumerate(counts):
        slot_base.append(run)
        tiles += [(combined, run + j, min(m_tile, count - j)) for j in range(0, count, m_tile)]
        run += -(-count // BLOCK_ROWS) * BLOCK_ROWS
    cursor, slot_route = list(slot_base), {}
    for route, combined in enumerate(routes):
        if combined >= 0:
            slot_route[cursor[combined]] = route
            cursor[combined] += 1
    return RoutePack(counts, slot_base, tiles, slot_route)


def plain_columns(rows: torch.Tensor) -> torch.Tensor:
    """Undo the expanded layout of the last dimension: per 16 columns, the even ones twice, then the odd
    ones twice (kernels/decode.cuh expanded_col)."""
    tiles = rows.reshape(*rows.shape[:-1], rows.shape[-1] // 32, 2, 8, 2)[..., 0]
    return tiles.transpose(-1, -2).reshape(*rows.shape[:-1], rows.shape[-1] // 2)
