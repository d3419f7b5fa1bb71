"""The route-pack algorithm (Python mirror of kernels/route_pack.cuh) and the launch plan: invariants."""

from __future__ import annotations

import random

import pytest
import torch

from trellis_cli.errors import CheckFailed
from lab.kernel.oracle import route_pack_reference
from trellis_cli.kernel.plan import (
    BLOCK_ROWS, LARGE_TILE, MID_TILE, SMALL_TILE, make_plan, slot_capacity, tile_capacity,
)
from trellis_cli.formats.layer_pack import LayerPack, descriptor


def tiny_pack(num_experts: int, tiers: list[int], unmapped: set[int] = frozenset(), skipped: set[int] = frozenset()):
    """Tables only (trellis tensors empty-but-shaped): all the route pack reads."""
    order = list(range(num_experts))
    random.Random(1).shuffle(order)
    g2c = [-1] * num_experts
    desc, start = [], 0
    for tier, count in enumerate(tiers):
        for local, expert in enumerate(sorted(order[start:start + count])):
            g2c[expert] = len(desc)
            desc.append(descriptor(tier, local))
        start += count
    for expert in unmapped:
        g2c[expert] = -1
    for combined in skipped:
        desc[combined] = -1
    trellis = [torch.zeros((count, 3, 0, 48), dtype=torch.int16) for count in tiers]
    return LayerPack(0, 0, 1, 128, 128, "mcg", [3] * len(tiers), trellis, torch.tensor(g2c, dtype=torch.int32),
                     torch.tensor(desc, dtype=torch.int32), torch.zeros(0), torch.zeros(0), torch.zeros(0),
                     torch.zeros(0))


def routes(m: int, num_experts: int, top_k: int, seed: int, hot: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if hot is not None:  # every token on the same few experts: the padding worst case for those experts
        return torch.arange(top_k).repeat(m, 1) % hot
    return torch.rand((m, num_experts), generator=gen).topk(top_k, dim=1).indices


def check_invariants(pack: LayerPack, ids: torch.Tensor, m_tile: int) -> None:
    rp = route_pack_reference(ids, pack, m_tile)
    g2c, desc = pack.global_to_combined.tolist(), pack.descriptors.tolist()
    flat = ids.reshape(-1).tolist()
    valid = [r for r, e in enumerate(flat) if 0 <= e < len(g2c) and g2c[e] >= 0 and desc[g2c[e]] >= 0]
    # every valid route lands in exactly one slot of its own expert's segment; nothing else does
    assert sorted(rp.slot_route.values()) == valid
    for slot, route in rp.slot_route.items():
        combined = g2c[flat[route]]
        assert rp.slot_base[combined] <= slot < rp.slot_base[combined] + rp.counts[combined]
    # segments are padded to whole m16 blocks, in combined order, without overlap
    for c in range(len(desc)):
        assert rp.slot_base[c] % BLOCK_ROWS == 0
        if c + 1 < len(desc):
            assert rp.slot_base[c + 1] - rp.slot_base[c] == -(-rp.counts[c] // BLOCK_ROWS) * BLOCK_ROWS
    # tiles cover each segment's live rows exactly once, in expert order, at most m_tile rows each
    covered = []
    for combined, start, rows in rp.tiles:
        assert 0 < rows <= m_tile and (start - rp.slot_base[combined]) % m_tile == 0
        covered += list(range(start, start + rows))
    assert sorted(covered) == sorted(rp.slot_route)
    assert [t[0] for t in rp.tiles] == sorted(t[0] for t in rp.tiles)
    # the host-side capacities bound the device's use
    numel = ids.numel()
    used_slots = rp.slot_base[-1] + -(-rp.counts[-1] // BLOCK_ROWS) * BLOCK_ROWS
    assert used_slots <= slot_capacity(numel, len(desc))
    assert len(rp.tiles) <= tile_capacity(numel, m_tile, len(desc))


@pytest.mark.parametrize("m_tile", [SMALL_TILE, MID_TILE, LARGE_TILE])
@pytest.mark.parametrize("m", [1, 3, 64, 700])
def test_route_pack_invariants_random_routes(m, m_tile):
    pack = tiny_pack(64, [40, 24])
    check_invariants(pack, routes(m, 64, 8, seed=m), m_tile)


def test_route_pack_worst_case_padding_and_hot_experts():
    pack = tiny_pack(64, [40, 24])
    for m in (1, 5, 129, 300):
        check_invariants(pack, routes(m, 64, 8, seed=0, hot=8), LARGE_TILE)
        check_invariants(pack, routes(m, 64, 8, seed=0, hot=8), SMALL_TILE)


def test_unmapped_skipped_and_out_of_range_ids_are_dropped():
    pack = tiny_pack(32, [20, 12], unmapped={3, 7}, skipped={0})
    ids = torch.tensor([[3, 7, 40, -1], [0, 1, 2, 31], [5, 6, 7, 8]])
    rp = route_pack_reference(ids, pack, SMALL_TILE)
    flat = ids.reshape(-1).tolist()
    served = {flat[r] for r in rp.slot_route.values()}
    assert not served & {3, 7, 40, -1}
    g2c = pack.global_to_combined.tolist()
    assert all(g2c[e] != 0 for e in served)  # combined 0's descriptor is -1
    check_invariants(pack, ids, SMALL_TILE)


def test_plan_depends_only_on_m_and_geometry():
    a = make_plan(64, 8, 6144, 512, 256)
    b = make_plan(64, 8, 6144, 512, 256)
    assert a == b and (6144 // 128) % a.k_split == 0
    assert make_plan(1, 8, 6144, 512, 256).m_tile == SMALL_TILE
    assert make_plan(3072, 8, 6144, 512, 256).m_tile == LARGE_TILE
    for m in (1, 3, 8, 64, 512, 3072, 8192):
        plan = make_plan(m, 8, 6144, 512, 256)
        assert (6144 // 128) % plan.k_split == 0
        assert plan.slot_capacity >= m * 8 and plan.tile_capacity >= 1


def test_direct_mode_for_the_smallest_batches():
    one, six, seven = (make_plan(m, 8, 6144, 512, 256) for m in (1, 6, 7))
    assert one.direct and six.direct and not seven.direct
    assert (one.m_tile, one.slot_capacity, one.tile_capacity) == (SMALL_TILE, 8, 8)
    assert not make_plan(1, 8, 6144, 512, 256, m_tile=MID_TILE).direct
    # FC1 keeps a direct route's input rows resident: at most 48 chunks of H per range
    assert make_plan(1, 8, 16384, 512, 256, k_split=1, direct=False).k_split == 1
    assert 128 // make_plan(1, 8, 16384, 512, 256).k_split <= 48
    with pytest.raises(CheckFailed, match="direct mode"):
        make_plan(1, 8, 16384, 512, 256, k_split=1)
