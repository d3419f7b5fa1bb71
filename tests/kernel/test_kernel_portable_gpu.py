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


@pytest.mark.parametrize("m", [1, 5, 8, 64, 200, 512])
def test_sm120_plans_on_the_mma_sync_build(portable_library, monkeypatch, m):
    from trellis_cli.kernel.launch import FusedMoe

    monkeypatch.setenv(PLAN_LIMITS_ENV, "sm_120")
    preset = Preset("small", 1024, 256, 32, 8, "mcg", (24, 8), (3, 4), 1)
    moe = FusedMoe(synthetic_pack(preset, device="cuda", seed=m), portable_library)
    assert (moe.limits.arch, moe.limits.source) == ("sm_120", "override")
    assert moe.limits.smem_per_block_optin == ARCH_TABLE["sm_120"].smem_per_block_optin
    x = random_activations(m, preset.hidden, device="cuda", seed=m)
    ids, w = random_routes(m, preset.experts, preset.top_k, device="cuda", seed=m + 1)
    plan = moe.plan(m, preset.top_k)
    assert plan.family in ("mma16", "mma32") and plan.m_tile in (16, 32)
    fused = moe.forward(x, ids, w)
    assert rel_l2(fused, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    assert rel_l2(fused, moe.two_pass(x, ids, w)) <= TWO_PASS_LIMIT
    assert torch.equal(fused, moe.forward(x, ids, w))  # repeat runs are bit-identical
