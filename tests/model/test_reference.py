"""Reference MoE forward against the real-quantized expert pool (tests/data/expert_pool_small)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_gpu

from trellis_cli import reference
from trellis_cli.codec import codebook_from_markers
from trellis_cli.errors import CheckFailed
from trellis_cli.formats.layer_pack import LayerPack, descriptor

HIDDEN, INTER_RANK, EXPERTS = 256, 128, 8
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def rel_l2(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found.double() - expected.double()).norm() / expected.double().norm()).item()


def projection(pool, expert: int, rank: int, name: str, k: int):
    prefix = f"e{expert}.r{rank}.{name}.K{k}"
    return pool[f"{prefix}.trellis"], pool[f"{prefix}.suh"], pool[f"{prefix}.svh"]


def rank_expert(pool, expert: int, rank: int, k: int):
    return tuple(projection(pool, expert, rank, name, k) for name in PROJECTIONS)


def pool_codebook(pool) -> str:
    return codebook_from_markers("e0.r0.gate_proj.K3.mcg" in pool, "e0.r0.gate_proj.K3.mul1" in pool)


def dense_expert(x, gate, up, down):
    return (F.silu(x @ gate) * (x @ up)) @ down


def weight_q(pool, expert, rank, name, k):
    return pool[f"e{expert}.r{rank}.{name}.K{k}.weight_q"].double()


@pytest.mark.parametrize("k", [3, 4])
def test_expert_forward_matches_dense_weight_q_per_rank_and_summed(golden, k):
    pool = golden("expert_pool_small")
    codebook = pool_codebook(pool)
    x = torch.randn(5, HIDDEN, dtype=torch.float64)
    for expert in (0, 5):
        partials = []
        for rank in (0, 1):
            y = reference.expert_forward(x, *rank_expert(pool, expert, rank, k), codebook)
            dense = dense_expert(x, *(weight_q(pool, expert, rank, name, k) for name in PROJECTIONS))
            assert y.dtype == torch.float64
            assert rel_l2(y, dense) <= 1e-3
            partials.append(y)
        full = dense_expert(
            x,
            torch.cat([weight_q(pool, expert, r, "gate_proj", k) for r in (0, 1)], dim=1),
            torch.cat([weight_q(pool, expert, r, "up_proj", k) for r in (0, 1)], dim=1),
            torch.cat([weight_q(pool, expert, r, "down_proj", k) for r in (0, 1)], dim=0),
        )
        assert rel_l2(partials[0] + partials[1], full) <= 1e-3


def test_float32_option_stays_close_to_float64(golden):
    pool = golden("expert_pool_small")
    x = torch.randn(3, HIDDEN)
    expert = rank_expert(pool, 2, 0, 4)
    y32 = reference.expert_forward(x, *expert, pool_codebook(pool), dtype=torch.float32)
    y64 = reference.expert_forward(x, *expert, pool_codebook(pool))
    assert y32.dtype == torch.float32
    assert rel_l2(y32, y64) <= 1e-5


def random_routes(tokens: int, topk: int, num_experts: int):
    ids = torch.stack([torch.randperm(num_experts)[:topk] for _ in range(tokens)])
    return ids, torch.rand(tokens, topk, dtype=torch.float32)


@pytest.mark.slow
def test_moe_forward_equals_per_token_loop(golden):
    pool = golden("expert_pool_small")
    codebook = pool_codebook(pool)
    served = {e: rank_expert(pool, e, 1, 3) for e in range(EXPERTS - 2)}  # 6 and 7 not served here
    x = torch.randn(9, HIDDEN, dtype=torch.float64)
    ids, weights = random_routes(9, 3, EXPERTS)
    out = reference.moe_forward(x, served, ids, weights, codebook)
    expected = torch.zeros_like(out)
    for t in range(9):
        for slot in range(3):
            expert = int(ids[t, slot])
            if expert in served:
                y = reference.expert_forward(x[t : t + 1], *served[expert], codebook)[0]
                expected[t] += float(weights[t, slot]) * y
    assert out.shape == (9, HIDDEN)
    assert rel_l2(out, expected) <= 1e-12


def build_pack(pool, tiers: dict[int, list[int]], shared_h: bool) -> tuple[LayerPack, dict]:
    """A route pack by hand: tiers {K: [global ids]}, the other experts not served; also the same experts
    as a moe_forward mapping (with the shared row substituted when shared_h)."""
    combined_ids = [e for k in sorted(tiers) for e in tiers[k]]
    experts = {}
    for k in sorted(tiers):
        for e in tiers[k]:
            gate, up, down = rank_expert(pool, e, 0, k)
            if shared_h:
                shared = rank_expert(pool, combined_ids[0], 0, sorted(tiers)[0])
                gate, up = (gate[0], shared[0][1], gate[2]), (up[0], shared[1][1], up[2])
                down = (down[0], down[1], shared[2][2])
            experts[e] = (gate, up, down)
    tier_trellis = [
        torch.stack([torch.stack([p[0].reshape(-1, 16 * k) for p in experts[e]]) for e in tiers[k]])
        for k in sorted(tiers)
    ]
    g2c = torch.full((EXPERTS,), -1, dtype=torch.int32)
    g2c[combined_ids] = torch.arange(len(combined_ids), dtype=torch.int32)
    descriptors = [descriptor(t, i) for t, k in enumerate(sorted(tiers)) for i in range(len(tiers[k]))]
    rows = combined_ids[:1] if shared_h else combined_ids
    pack = LayerPack(
        layer=3, rank=0, tp=2, hidden=HIDDEN, intermediate=INTER_RANK, codebook=pool_codebook(pool),
        tier_k=sorted(tiers), tier_trellis=tier_trellis, global_to_combined=g2c,
        descriptors=torch.tensor(descriptors, dtype=torch.int32),
        rot_intermediate=torch.stack(
            [torch.stack([experts[e][0][2], experts[e][1][2], experts[e][2][1]]) for e in combined_ids]
        ),
        gate_suh=torch.stack([experts[e][0][1] for e in rows]),
        up_suh=torch.stack([experts[e][1][1] for e in rows]),
        down_svh=torch.stack([experts[e][2][2] for e in rows]),
    )
    return pack, experts


@pytest.mark.slow
@pytest.mark.parametrize("shared_h", [False, True])
def test_layer_pack_forward_equals_moe_forward(golden, shared_h):
    pool = golden("expert_pool_small")
    pack, experts = build_pack(pool, {3: [1, 4, 6], 4: [0, 2, 5]}, shared_h)  # 3 and 7 not served
    assert pack.shared_h == shared_h
    x = torch.randn(11, HIDDEN, dtype=torch.float64)
    ids, weights = random_routes(11, 4, EXPERTS)
    from_pack = reference.layer_pack_forward(pack, x, ids, weights)
    expected = reference.moe_forward(x, experts, ids, weights, pack.codebook)
    assert torch.equal(from_pack, expected)
    assert from_pack.abs().max() > 0


def test_bad_routes_raise_check_failed(golden):
    pool = golden("expert_pool_small")
    pack, experts = build_pack(pool, {3: [0, 1]}, shared_h=False)
    x = torch.randn(2, HIDDEN, dtype=torch.float64)
    with pytest.raises(CheckFailed, match="topk_weights"):
        reference.moe_forward(x, experts, torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 3), "mcg")
    with pytest.raises(CheckFailed, match="expert id 8"):
        reference.layer_pack_forward(pack, x, torch.full((2, 1), 8), torch.ones(2, 1))
    with pytest.raises(CheckFailed, match="dtype"):
        reference.moe_forward(x, experts, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), "mcg", torch.float16)


@requires_gpu
@pytest.mark.gpu
def test_layer_pack_forward_on_cuda_matches_cpu(golden):
    pool = golden("expert_pool_small")
    pack, _ = build_pack(pool, {3: [1, 4], 4: [0, 2, 5]}, shared_h=False)
    x = torch.randn(6, HIDDEN, dtype=torch.float64)
    ids, weights = random_routes(6, 2, EXPERTS)
    on_cpu = reference.layer_pack_forward(pack, x, ids, weights)
    cuda_pack = LayerPack(**{
        name: [t.cuda() for t in value] if name == "tier_trellis" else value.cuda() if torch.is_tensor(value) else value
        for name, value in vars(pack).items()
    })
    on_gpu = reference.layer_pack_forward(cuda_pack, x.cuda(), ids.cuda(), weights.cuda())
    assert on_gpu.device.type == "cuda"
    assert rel_l2(on_gpu.cpu(), on_cpu) <= 1e-12
