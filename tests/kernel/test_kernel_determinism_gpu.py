"""Repeat calls are bit-identical where an expert's routes fill several work tiles and FC1 cuts the tail of
its work finer (kernels/fc1_split.cuh). Routes sit inside an expert's segment in the order of atomics, so a
cut of the tail inside one expert let a route land in a tile summed from more planes on one call and fewer
on the next: the portable build under sm_120's limits failed `bench --smoke`'s repeat check at M=3072
(glm52-tp4, 32-row tiles, tail x4) on an H200. Skipped cleanly without a CUDA device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import requires_gpu
from trellis_cli.bench.smoke import REFERENCE_LIMIT, rel_l2
from trellis_cli.bench.synthetic import Preset, random_activations, synthetic_pack
from trellis_cli.kernel.arch_limits import PLAN_LIMITS_ENV
from trellis_cli.kernel.nvcc import MMA_SYNC_ONLY_ENV
from trellis_cli.reference import layer_pack_forward

pytestmark = [requires_gpu, pytest.mark.gpu]

# glm52-tp4's rank shape with fewer experts; routes favour HOT of them, as real routers favour some experts, so
# that those experts' routes fill several tiles each and the tail's nominal cut falls inside one of them.
SERVED = Preset("served", 6144, 512, 128, 8, "mcg", (96, 32), (3, 4), 4)
FEW_EXPERTS = Preset("few-experts", 6144, 512, 32, 8, "mcg", (24, 8), (3, 4), 4)
FEW_EXPERTS_K5 = Preset("few-experts-k5", 6144, 512, 32, 8, "mcg", (24, 8), (3, 5), 4)
HOT = 16
REPEATS = 6


def skewed_routes(m: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per token, most of them among the first HOT experts, and softmax weights."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand((m, experts), generator=gen, device="cuda")
    scores[:, :HOT] += 0.75
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32).contiguous()
    return ids, torch.softmax(torch.randn((m, top_k), generator=gen, device="cuda"), dim=1).float().contiguous()


@pytest.fixture(scope="module")
def production_library():
    from trellis_cli.kernel.abi import default_library

    return default_library("mcg", kernels="k3k4")


@pytest.fixture(scope="module")
def portable_library():
    from trellis_cli.kernel.abi import default_library

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MMA_SYNC_ONLY_ENV, "1")
        return default_library("mcg", kernels="k3k4")


def assert_repeats_identical(moe, preset: Preset, m: int, plan=None, finer_tail: bool = True) -> None:
    x = random_activations(m, preset.hidden, device="cuda", seed=m)
    ids, w = skewed_routes(m, preset.experts, preset.top_k, seed=m + 1)
    plan = plan or moe.plan(m, preset.top_k)
    if finer_tail:
        assert plan.fc1_tail_split > 1, plan  # the case under test: a finer tail
    first = moe.forward(x, ids, w, plan=plan)
    assert rel_l2(first, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    for repeat in range(REPEATS):
        again = moe.forward(x, ids, w, plan=plan)
        differing = int((again != first).sum())
        assert differing == 0, f"M={m} {plan}: repeat {repeat} differs in {differing} values"


@pytest.mark.parametrize("m", [64, 128, 256])  # H200: 16-row tiles, then the narrow wgmma kernels, tail x4
def test_repeats_bit_identical_on_the_production_build(production_library, m):
    from trellis_cli.kernel.launch import FusedMoe

    moe = FusedMoe(synthetic_pack(SERVED, device="cuda", seed=3), production_library)
    assert_repeats_identical(moe, SERVED, m)


@pytest.mark.parametrize("m", [512, 1024, 3072])
def test_repeats_bit_identical_under_sm120_limits(portable_library, monkeypatch, m):
    """32-row tiles with the finer tail, both forced: from 40 routes per expert the plan takes 128 rows, and
    sm_120's plans take whole H ranges (one 32-row FC1 CTA per SM in 100 KB); sm_100's keep the tail."""
    from trellis_cli.kernel.launch import FusedMoe
    from trellis_cli.kernel.plan import make_plan

    monkeypatch.setenv(PLAN_LIMITS_ENV, "sm_120")
    moe = FusedMoe(synthetic_pack(FEW_EXPERTS, device="cuda", seed=3), portable_library)
    assert moe.limits.arch == "sm_120"
    p = FEW_EXPERTS
    plan = make_plan(m, p.top_k, p.hidden, p.intermediate, p.experts, m_tile=32, num_experts=p.experts,
                     limits=moe.limits, codebook=p.codebook, fast=True, usage=moe.usage)
    assert plan.fc1_tail_split == 1
    assert_repeats_identical(moe, FEW_EXPERTS, m, dataclasses.replace(plan, fc1_tail_split=4))


@pytest.mark.parametrize("kernels", ["k3k4", "all"])
@pytest.mark.parametrize("m", [1024, 3072])
def test_repeats_bit_identical_on_large_tiles_under_sm120_limits(monkeypatch, kernels, m):
    """The 128-row tiles within 99 KB (FC1, and the all-K FC2, in smaller chunks), K3/K4 and K3/K5, on skewed
    routes: an expert's routes fill several tiles."""
    from trellis_cli.kernel.abi import default_library
    from trellis_cli.kernel.launch import FusedMoe

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MMA_SYNC_ONLY_ENV, "1")
        library = default_library("mcg", kernels=kernels)
    monkeypatch.setenv(PLAN_LIMITS_ENV, "sm_120")
    preset = FEW_EXPERTS if kernels == "k3k4" else FEW_EXPERTS_K5
    moe = FusedMoe(synthetic_pack(preset, device="cuda", seed=5), library)
    plan = moe.plan(m, preset.top_k)
    assert plan.m_tile == 128, plan
    assert_repeats_identical(moe, preset, m, plan, finer_tail=False)
