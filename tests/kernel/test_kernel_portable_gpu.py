"""The portable path on a GPU under another arch's limits: the mma.sync-only build (TRELLIS_MMA_SYNC_ONLY=1) with
every plan made for sm_120's limits (TRELLIS_PLAN_LIMITS=sm_120), against the float64 reference. Skipped
cleanly without a CUDA device; lab/perf/sm120_limits.sh runs the production-size smoke and sweep."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_gpu
from trellis_cli.bench.smoke import REFERENCE_LIMIT, TWO_PASS_LIMIT, rel_l2
from trellis_cli.bench.synthetic import Preset, random_activations, random_routes, synthetic_pack
from trellis_cli.kernel.arch_limits import ARCH_TABLE, PLAN_LIMITS_ENV
from trellis_cli.kernel.nvcc import MMA_SYNC_ONLY_ENV
from trellis_cli.reference import layer_pack_forward

pytestmark = [requires_gpu, pytest.mark.gpu]


@pytest.fixture(scope="module")
def portable_library():
    from trellis_cli.kernel.abi import default_library

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MMA_SYNC_ONLY_ENV, "1")
        library = default_library("mcg", kernels="k3k4")
    assert not library.wgmma
    return library


SMALL = Preset("small", 1024, 256, 32, 8, "mcg", (24, 8), (3, 4), 1)
# Every K from 2 to 6 in one layer: served by the all-K kernels, whose FC1 stages half chunks on builds
# without wgmma (kernels/gemm_tile.cuh fc1_chunk_tiles) so that they fit 99 KB.
EVERY_K = Preset("every-k", 1024, 256, 32, 8, "mcg", (8, 8, 8, 4, 4), (2, 3, 4, 5, 6), 1)
CODEBOOKS = ("mcg", "3inst", "mul1")


def portable_build(codebook: str, kernels: str):
    from trellis_cli.kernel.abi import default_library

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MMA_SYNC_ONLY_ENV, "1")
        library = default_library(codebook, kernels=kernels)
    assert not library.wgmma
    return library


def check_call(moe, preset: Preset, m: int, plan=None) -> None:
    """Fused against float64 and the two-pass baseline (same plan), repeats bit-identical, on fresh inputs."""
    x = random_activations(m, preset.hidden, device="cuda", seed=m)
    ids, w = random_routes(m, preset.experts, preset.top_k, device="cuda", seed=m + 1)
    fused = moe.forward(x, ids, w, plan=plan)
    assert rel_l2(fused, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    assert rel_l2(fused, moe.two_pass(x, ids, w, plan=plan)) <= TWO_PASS_LIMIT
    for _ in range(3):
        assert torch.equal(fused, moe.forward(x, ids, w, plan=plan))  # repeat runs are bit-identical


@pytest.mark.parametrize("m", [1, 5, 8, 64, 200, 512])
def test_sm120_plans_on_the_mma_sync_build(portable_library, monkeypatch, m):
    from trellis_cli.kernel.launch import FusedMoe

    monkeypatch.setenv(PLAN_LIMITS_ENV, "sm_120")
    moe = FusedMoe(synthetic_pack(SMALL, device="cuda", seed=m), portable_library)
    assert (moe.limits.arch, moe.limits.source) == ("sm_120", "override")
    assert moe.limits.smem_per_block_optin == ARCH_TABLE["sm_120"].smem_per_block_optin
    plan = moe.plan(m, SMALL.top_k)
    assert plan.family == f"mma{plan.m_tile}"  # from 40 routes per expert 128-row tiles within 99 KB
    assert plan.m_tile == (128 if m >= 200 else 32 if m >= 64 else 16), plan  # 50 routes per expert from 200
    check_call(moe, SMALL, m)


# Each tile family under sm_120's limits, forced: direct 16-row tiles, packed 16, 32 and 128 rows.
FAMILIES = ((3, None), (16, 16), (64, 32), (512, 128))


@pytest.mark.parametrize("m, m_tile", FAMILIES[1:])
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_k3k4_tiles_under_sm120_limits(monkeypatch, codebook, m, m_tile):
    from trellis_cli.kernel.launch import FusedMoe
    from trellis_cli.kernel.plan import make_plan

    monkeypatch.setenv(PLAN_LIMITS_ENV, "sm_120")
    moe = FusedMoe(synthetic_pack(SMALL, device="cuda", seed=m, codebook=codebook), portable_build(codebook, "k3k4"))
    plan = make_plan(m, SMALL.top_k, SMALL.hidden, SMALL.intermediate, SMALL.experts, m_tile=m_tile,
                     num_experts=SMALL.experts, limits=moe.limits, codebook=codebook, fast=True, usage=moe.usage)
    assert plan.m_tile == m_tile and not plan.direct
    check_call(moe, SMALL, m, plan)


@pytest.mark.parametrize("m, m_tile", FAMILIES)
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_every_k_under_sm120_limits(monkeypatch, codebook, m, m_tile):
    """K 2..6 in one layer on every tile family under 99 KB (the all-K FC1 and 128-row FC2 in smaller chunks)."""
    from trellis_cli.kernel.launch import FusedMoe
    from trellis_cli.kernel.plan import make_plan

    monkeypatch.setenv(PLAN_LIMITS_ENV, "sm_120")
    moe = FusedMoe(synthetic_pack(EVERY_K, device="cuda", seed=m, codebook=codebook), portable_build(codebook, "all"))
    assert sorted(set(moe.pack.tier_k)) == [2, 3, 4, 5, 6]
    plan = make_plan(m, EVERY_K.top_k, EVERY_K.hidden, EVERY_K.intermediate, EVERY_K.experts, m_tile=m_tile,
                     num_experts=EVERY_K.experts, limits=moe.limits, codebook=codebook, fast=False, usage=moe.usage)
    assert plan.direct == (m_tile is None) and plan.m_tile == (m_tile or 16)
    check_call(moe, EVERY_K, m, plan)


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_every_k_on_128_row_tiles_under_sm80_limits(monkeypatch, codebook):
    """A100's plans: the all-K 128-row kernels of a build without wgmma."""
    from trellis_cli.kernel.launch import FusedMoe

    monkeypatch.setenv(PLAN_LIMITS_ENV, "sm_80")
    moe = FusedMoe(synthetic_pack(EVERY_K, device="cuda", seed=9, codebook=codebook), portable_build(codebook, "all"))
    plan = moe.plan(512, EVERY_K.top_k)
    assert (plan.m_tile, plan.family) == (128, "mma128"), plan
    check_call(moe, EVERY_K, 512)


@pytest.mark.parametrize("hidden", [1024, 640])
@pytest.mark.parametrize("kernels, tier_k", [("k3k4", (3, 4)), ("all", (3, 5))])
def test_compact_kernels_compute_the_bits_of_the_full_ones(kernels, tier_k, hidden):
    """The compact 128-row kernels walk each 128-column chunk in smaller pieces, adding the same products in the
    same order: on a layer whose I is no multiple of 256 the wgmma build's 128-row tiles run the full mma.sync
    kernels, and both builds give the same bits on one plan (H = 640: an odd count of 128-column blocks)."""
    from trellis_cli.kernel.abi import default_library
    from trellis_cli.kernel.launch import FusedMoe
    from trellis_cli.kernel.plan import make_plan

    production = default_library("mcg", kernels=kernels)
    if not production.wgmma:
        pytest.skip("needs a GPU with wgmma (sm_90) for the full kernels beside the compact ones")
    preset = Preset("odd-i", hidden, 384, 16, 8, "mcg", (12, 4), tier_k, 1)
    pack = synthetic_pack(preset, device="cuda", seed=11)
    full, compact = FusedMoe(pack, production), FusedMoe(pack, portable_build("mcg", kernels))
    m = 512
    plan = make_plan(m, preset.top_k, preset.hidden, preset.intermediate, preset.experts, m_tile=128,
                     num_experts=preset.experts)
    x = random_activations(m, preset.hidden, device="cuda", seed=12)
    ids, w = random_routes(m, preset.experts, preset.top_k, device="cuda", seed=13)
    out = compact.forward(x, ids, w, plan=plan)
    assert rel_l2(out, layer_pack_forward(pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    assert torch.equal(out, full.forward(x, ids, w, plan=plan))
