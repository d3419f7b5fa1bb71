"""The fused kernel on a GPU: everything `trellis bench --smoke` checks, on small and production layers.

Skipped cleanly without a CUDA device. Small layers (H=512, I=256, 16 experts) cover every codebook,
every K pair and the input/output dtypes quickly; the production shape (glm52-tp4) covers M=3072, where
a numerically unsafe tile would show up as fused vs two-pass > 1e-4.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import requires_gpu
from trellis_cli.bench.smoke import (
    REFERENCE_LIMIT, TWO_PASS_LIMIT, accuracy_checks, determinism_checks, partition_reuse_checks, rel_l2,
    unmapped_check,
)
from trellis_cli.bench.synthetic import PRESETS, Preset, random_activations, random_routes, synthetic_pack
from trellis_cli.errors import CheckFailed
from trellis_cli.kernel.plan import make_plan
from trellis_cli.reference import layer_pack_forward

pytestmark = [requires_gpu, pytest.mark.gpu]


def small(codebook="mcg", tier_k=(3, 4), partition=(12, 4), shared_h=False) -> Preset:
    return Preset("small", 512, 256, 16, 4, codebook, partition, tier_k, 1, shared_h=shared_h)


@pytest.fixture(scope="module")
def library():
    from trellis_cli.kernel.abi import default_library

    return default_library()


@pytest.fixture(scope="module")
def lab_library():
    """The lab build of the mcg library (lab/kernel/lab.py): the calls that take lab flags."""
    from lab.kernel.lab import lab_library

    return lab_library("mcg")


def lab_twin(moe, lab_library):
    """The same layer on the lab build, whose calls take lab flags."""
    from lab.kernel.lab import LabMoe

    return LabMoe(moe.pack, lab_library)


def moe_for(preset: Preset, library, seed=1, **kw):
    from trellis_cli.kernel.launch import FusedMoe

    # A library holds one codebook's kernels (mcg here); another codebook's layer takes its own, built on first use.
    pack = synthetic_pack(preset, device="cuda", seed=seed, **kw)
    return FusedMoe(pack, library if pack.codebook == library.codebook else None)


def assert_checks(checks):
    failed = [c for c in checks if not c.passed]
    assert not failed, failed


@pytest.mark.parametrize("codebook", ["mcg", "mul1", "3inst"])
@pytest.mark.parametrize("m", [1, 3, 64])
def test_every_codebook_matches_reference(library, codebook, m):
    moe = moe_for(small(codebook), library)
    assert_checks(accuracy_checks(moe, codebook, m, seed=m))


@pytest.mark.parametrize("tier_k", [(1, 2), (3, 4), (5, 6), (7, 8), (2, 8)])
def test_every_k_matches_reference(library, tier_k):
    moe = moe_for(small(tier_k=tier_k), library)
    assert_checks(accuracy_checks(moe, f"K{tier_k}", 7, seed=3))


@pytest.mark.parametrize("partition", [(16, 0), (0, 16), (15, 1), (1, 15)])
def test_single_tier_and_lopsided_partitions(library, partition):
    moe = moe_for(small(partition=partition), library)
    assert_checks(accuracy_checks(moe, str(partition), 64, seed=4))


def test_large_tile_path_on_small_layer(library):
    moe = moe_for(small(), library)
    assert moe.plan(700, 4).m_tile == 128
    assert_checks(accuracy_checks(moe, "small", 700, seed=5))


@pytest.mark.parametrize("tier_k", [(3, 4), (2, 5)])
def test_large_tiles_of_every_route_count(library, lab_library, tier_k):
    # On Hopper a 128-row tile multiplies as many route columns as its routes rounded up to a multiple of
    # 16 (kernels/expert_wgmma.cuh with_n; the all-K kernel always 128), and where experts average few routes
    # K3/K4 layers run the narrow kernels, 64 routes per pass (a tile of more takes two). Here the 16
    # experts get 1, 16, 17, 32, ..., 113 and 128 routes: every width at both ends of its range, and 1 or 2
    # narrow passes. Both kinds of kernel must give the same bits (forced by the lab build's flags).
    from lab.kernel import lab

    counts = [1, 16, 17, 32, 33, 48, 49, 64, 65, 80, 81, 96, 97, 112, 113, 128]
    moe = moe_for(small(tier_k=tier_k), library)
    m = sum(counts) // 4
    assert moe.plan(m, 4).m_tile == 128
    x = random_activations(m, 512, device="cuda", seed=8)
    _, w = random_routes(m, 16, 4, device="cuda", seed=9)
    # route r = slot * m + token, in expert order: an expert's routes (at most 128 < m) go to distinct tokens
    experts = torch.repeat_interleave(torch.arange(16), torch.tensor(counts))
    ids = experts.view(4, m).t().contiguous().to(device="cuda", dtype=torch.int32)
    assert torch.equal(torch.bincount(ids.flatten().long(), minlength=16).cpu(), torch.tensor(counts))
    fused = moe.forward(x, ids, w)
    assert rel_l2(fused, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    assert rel_l2(fused, moe.two_pass(x, ids, w)) <= TWO_PASS_LIMIT
    twin = lab_twin(moe, lab_library)
    for flags in (0, lab.WGMMA_NARROW, lab.WGMMA_WIDE):
        assert torch.equal(twin.forward(x, ids, w, lab_flags=flags), fused), flags


@pytest.mark.parametrize("m, m_tile, direct", [(1, 16, True), (5, 16, True), (20, 16, False), (100, 32, False),
                                                (300, 128, False), (700, 128, False)])
def test_shared_h_on_every_tile_kind(library, m, m_tile, direct):
    # One svh row for all experts: FC2 leaves its rows unrotated and the top-k sum applies H128 and svh once
    # per token (kernels/expert_gemm.cuh store_down_rows), on every kind of tile and in direct mode.
    moe = moe_for(small(shared_h=True), library)
    assert moe.pack.down_svh.shape[0] == 1 and moe.pack.gate_suh.shape[0] == 1
    x = random_activations(m, 512, device="cuda", seed=m + 30)
    ids, w = random_routes(m, 16, 4, device="cuda", seed=m + 31)
    plan = make_plan(m, 4, 512, 256, 16, m_tile=m_tile, direct=direct, wgmma=library.wgmma)
    fused = moe.forward(x, ids, w, plan=plan)
    assert rel_l2(fused, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    assert rel_l2(fused, moe.two_pass(x, ids, w, plan=plan)) <= TWO_PASS_LIMIT
    assert torch.equal(moe.forward(x, ids, w, plan=plan), fused)


@pytest.mark.parametrize("shared", ["gate_up", "down"])
@pytest.mark.parametrize("m, m_tile", [(20, 16), (300, 128)])
def test_partly_shared_rotation_rows(library, shared, m, m_tile):
    # The input side (gate and up suh) and the output side (down svh) take the per-token paths independently.
    from trellis_cli.kernel.launch import FusedMoe

    pack = synthetic_pack(small(), device="cuda", seed=40)
    if shared == "gate_up":
        pack = dataclasses.replace(pack, gate_suh=pack.gate_suh[:1].clone(), up_suh=pack.up_suh[:1].clone())
    else:
        pack = dataclasses.replace(pack, down_svh=pack.down_svh[:1].clone())
    moe = FusedMoe(pack, library)
    x = random_activations(m, 512, device="cuda", seed=41)
    ids, w = random_routes(m, 16, 4, device="cuda", seed=42)
    plan = make_plan(m, 4, 512, 256, 16, m_tile=m_tile, wgmma=library.wgmma)
    fused = moe.forward(x, ids, w, plan=plan)
    assert rel_l2(fused, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    assert rel_l2(fused, moe.two_pass(x, ids, w, plan=plan)) <= TWO_PASS_LIMIT


def test_mid_tile_path_on_small_layer(library):
    # 25 routes per expert: 32-row tiles where large tiles run on mma.sync. The Hopper wgmma build takes
    # 128-row tiles from 11 routes per expert on (plan.py), so there the 32-row kernels run by an explicit plan.
    moe = moe_for(small(), library)
    shape = (moe.pack.hidden, moe.pack.intermediate, moe.pack.num_combined)
    assert make_plan(100, 4, *shape, wgmma=False).m_tile == 32
    assert moe.plan(100, 4).m_tile == (128 if library.wgmma else 32)
    plan = make_plan(100, 4, *shape, m_tile=32, wgmma=library.wgmma)
    x = random_activations(100, 512, device="cuda", seed=6)
    ids, w = random_routes(100, 16, 4, device="cuda", seed=7)
    fused = moe.forward(x, ids, w, plan=plan)
    assert rel_l2(fused, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT
    # two-pass on the same tiles (the default plan's merged 128-row weights round differently)
    assert rel_l2(fused, moe.two_pass(x, ids, w, plan=plan)) <= TWO_PASS_LIMIT


@pytest.mark.parametrize("m", [16, 64, 400, 700])
def test_fc1_tail_pieces(library, m):
    # hidden 6144 = 48 chunks of 128: with one or two H ranges per item FC1 cuts the ranges of its last
    # half wave in 4 pieces, each piece into its own plane of partial sums that the activation adds in
    # order. Small and mid tiles and, on Hopper, the narrow wgmma kernels (M=400: 25 routes per expert)
    # have a tail; wgmma at M=700 (44 routes) has none.
    moe = moe_for(Preset("wide-h", 6144, 256, 64, 4, "mcg", (48, 16), (3, 4), 1), library)
    assert_checks(accuracy_checks(moe, "wide-h", m, seed=m))
    x = random_activations(m, 6144, device="cuda", seed=m + 1)
    ids, w = random_routes(m, 64, 4, device="cuda", seed=m + 2)
    ref = layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)
    for k_split in (1, 2):
        plan = make_plan(m, 4, 6144, 256, 64, k_split=k_split, wgmma=library.wgmma)
        assert plan.fc1_tail_split == (1 if m == 700 and library.wgmma else 4)
        fused = moe.forward(x, ids, w, plan=plan)
        assert rel_l2(fused, ref) <= REFERENCE_LIMIT
        whole = moe.forward(x, ids, w, plan=dataclasses.replace(plan, fc1_tail_split=1))
        if plan.fc1_tail_split > 1:
            # the same products added in another order, which moves some fp16 roundings of the activation
            # by one step (about 1e-4 here), far inside the reference limit
            assert 0 < rel_l2(fused, whole) <= REFERENCE_LIMIT / 4
        else:
            assert torch.equal(fused, whole)


@pytest.mark.parametrize("hidden, intermediate", [(1536, 2048), (512, 4096)])
@pytest.mark.parametrize("m", [1, 64])
def test_wide_intermediate(library, hidden, intermediate, m):
    # 2048 or 4096 intermediate channels per rank (GLM at TP2 or TP1) take 16 or 32 warps of activation per
    # route row, more than one CTA has registers for: the kernel spreads them over several CTAs.
    moe = moe_for(Preset("wide-i", hidden, intermediate, 8, 4, "mcg", (6, 2), (3, 4), 1), library)
    assert_checks(accuracy_checks(moe, f"I={intermediate}", m, seed=m))


@pytest.mark.parametrize("intermediate", [256, 384, 512])
@pytest.mark.parametrize("m, m_tile", [(16, 16), (48, 16), (100, 32)])
def test_fc2_output_blocks_per_cta_leave_results_unchanged(library, lab_library, intermediate, m, m_tile):
    # FC2 CTAs of 16- and 32-row tiles walk up to 4 output blocks of their tile, the copy ring running on
    # from one block into the next, where the grid has waves to spare (gemm_unit.cu fc2_span); the lab
    # build's flag forces the widest span on this small layer (H/128 = 8 blocks: 2 CTAs per tile). I/128 = 3
    # is no power of two: one block per CTA there.
    from lab.kernel import lab

    moe = moe_for(Preset("span", 1024, intermediate, 16, 4, "mcg", (12, 4), (3, 4), 1), library)
    plan = make_plan(m, 4, 1024, intermediate, 16, m_tile=m_tile, wgmma=library.wgmma)
    assert plan.m_tile == m_tile and not plan.direct
    x = random_activations(m, 1024, device="cuda", seed=m)
    ids, w = random_routes(m, 16, 4, device="cuda", seed=m + 1)
    one = moe.forward(x, ids, w, plan=plan)
    wide = lab_twin(moe, lab_library).forward(x, ids, w, plan=plan, lab_flags=lab.FC2_WIDE_SPAN)
    assert torch.equal(one, wide)
    assert rel_l2(wide, layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)) <= REFERENCE_LIMIT


@pytest.mark.parametrize("m, m_tile, direct", [(2, 16, True), (5, 16, True), (20, 16, True), (20, 16, False),
                                                (100, 32, False)])
def test_tiles_hand_over_one_by_one(library, lab_library, m, m_tile, direct):
    # 16- and 32-row tiles (and direct mode from two tokens on) go from FC1 to the activation to FC2 tile by
    # tile, through counters in the workspace (kernels/handover.cuh). Every call must leave them at zero,
    # also one of the lab build that skipped a phase, or the next call would read a tile too early. M=20 in
    # direct mode (80 routes) is past the plan's own direct-mode limit: the counters follow the tile capacity.
    from lab.kernel import lab

    moe = moe_for(small(), library)
    twin = lab_twin(moe, lab_library)
    x = random_activations(m, 512, device="cuda", seed=m)
    ids, w = random_routes(m, 16, 4, device="cuda", seed=m + 1)
    ref = layer_pack_forward(moe.pack, x, ids, w, dtype=torch.float64)
    for k_split in (1, 4):  # FC1 pieces per tile: 2 items x k_split H ranges
        plan = make_plan(m, 4, 512, 256, 16, m_tile=m_tile, k_split=k_split, direct=direct, wgmma=library.wgmma)
        assert (plan.direct, plan.m_tile, plan.k_split) == (direct, m_tile, k_split)
        first = moe.forward(x, ids, w, plan=plan)
        assert rel_l2(first, ref) <= REFERENCE_LIMIT
        for runner in (moe, twin):
            runner.forward(x, ids, w, plan=plan)
            torch.cuda.synchronize()
            assert not runner._workspace(plan)["handover"].any(), k_split
        counters = twin._workspace(plan)["handover"]
        for flags in (0, lab.SKIP_FC1, lab.SKIP_ACT, lab.SKIP_FC2, lab.NO_PDL, 0):
            out = twin.forward(x, ids, w, plan=plan, lab_flags=flags)
            torch.cuda.synchronize()
            assert not counters.any(), (k_split, flags)
            if flags in (0, lab.NO_PDL):  # phases one after another: the counters are full before anyone waits
                assert torch.equal(out, first), (k_split, flags)


def test_dtypes_int64_ids_and_outputs(library):
    moe = moe_for(small(), library)
    x = random_activations(9, 512, device="cuda", seed=6, dtype=torch.float16)
    ids, w = random_routes(9, 16, 4, device="cuda", seed=7)
    ref = layer_pack_forward(moe.pack, x, ids, w)
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = moe.forward(x, ids.long(), w, out_dtype=out_dtype)
        assert out.dtype == out_dtype
        assert rel_l2(out, ref) <= (REFERENCE_LIMIT if out_dtype == torch.float32 else 1e-2)


def test_bad_inputs_are_named_errors(library):
    moe = moe_for(small(), library)
    x = random_activations(2, 512, device="cuda", seed=6)
    ids, w = random_routes(2, 16, 4, device="cuda", seed=7)
    with pytest.raises(CheckFailed, match="x:"):
        moe.forward(x.float(), ids, w)
    with pytest.raises(CheckFailed, match="topk_weights"):
        moe.forward(x, ids, w.half())
    with pytest.raises(CheckFailed, match="x:"):
        moe.forward(x.cpu(), ids, w)
    # a plan the library cannot follow is refused before anything launches (4 chunks of H: no 3-way cut)
    plan = dataclasses.replace(moe.plan(2, 4), fc1_tail_split=3)
    with pytest.raises(CheckFailed, match="fc1_tail_split"):
        moe.forward(x, ids, w, plan=plan)


def test_out_of_range_and_negative_ids_contribute_zero(library):
    moe = moe_for(small(), library)
    x = random_activations(4, 512, device="cuda", seed=8)
    ids, w = random_routes(4, 16, 4, device="cuda", seed=9)
    bad = ids.clone()
    bad[:, 0] = torch.tensor([-1, 16, 1000, -5], dtype=torch.int32)
    zeroed = w.clone()
    zeroed[:, 0] = 0
    assert torch.equal(moe.forward(x, bad, w), moe.forward(x, ids, zeroed))


def test_nan_input_stays_in_its_token(library):
    """A NaN in one token's input makes that token's output NaN, never a finite value (the fp16 roundings
    saturate finite outliers only), and leaves every other token bit-identical: direct mode, 16-row and
    128-row tiles."""
    moe = moe_for(small(), library)
    plans = [moe.plan(m, 4) for m in (1, 40, 700)]
    assert [(p.direct, p.m_tile) for p in plans] == [(True, 16), (False, 16), (False, 128)]
    for m in (1, 40, 700):
        x = random_activations(m, 512, device="cuda", seed=30 + m)
        ids, w = random_routes(m, 16, 4, device="cuda", seed=31 + m)
        clean = moe.forward(x, ids, w)
        poisoned = x.clone()
        poisoned[m // 2, 7] = float("nan")
        out = moe.forward(poisoned, ids, w)
        assert torch.isnan(out[m // 2]).all()
        others = torch.arange(m, device="cuda") != m // 2
        assert torch.equal(out[others], clean[others])


def test_determinism_graph_and_unmapped_on_small_layer(library):
    moe = moe_for(small(), library)
    for m in (1, 64, 700):
        assert_checks(determinism_checks(moe, "small", m, seed=m))
    assert unmapped_check(moe, "small", 64, seed=10).passed


def test_two_partitions_one_compiled_object(library):
    a = synthetic_pack(small(partition=(12, 4)), device="cuda", seed=11)
    b = synthetic_pack(small(partition=(5, 11)), device="cuda", seed=12)
    assert_checks(partition_reuse_checks([("12/4", a), ("5/11", b)], library, 32, seed=13))


def test_m_zero_and_m_8192(library):
    moe = moe_for(small(), library)
    x = random_activations(8192, 512, device="cuda", seed=14)
    ids, w = random_routes(8192, 16, 4, device="cuda", seed=15)
    out = moe.forward(x, ids, w)
    assert torch.isfinite(out).all()
    assert rel_l2(out, moe.two_pass(x, ids, w)) <= TWO_PASS_LIMIT
    empty = moe.forward(x[:0], ids[:0], w[:0])
    assert empty.shape == (0, 512)


@pytest.mark.slow
def test_production_shape_large_m_is_numerically_safe(library):
    """glm52-tp4 192/64 at M=3072: fused vs two-pass <= 1e-4 and vs float64 <= 1e-3."""
    from trellis_cli.kernel.launch import FusedMoe

    moe = FusedMoe(synthetic_pack(PRESETS["glm52-tp4"], device="cuda", seed=21), library)
    assert_checks(accuracy_checks(moe, "glm52-tp4 192/64", 3072, seed=22))
    assert_checks(accuracy_checks(moe, "glm52-tp4 192/64", 1, seed=23))
    assert_checks(determinism_checks(moe, "glm52-tp4 192/64", 3072, seed=24))
    del moe
    shared = FusedMoe(synthetic_pack(PRESETS["glm52-tp4-shared-h"], device="cuda", seed=25), library)
    for m in (1, 64, 3072):
        assert_checks(accuracy_checks(shared, "glm52-tp4 shared-H", m, seed=26 + m))
    assert_checks(determinism_checks(shared, "glm52-tp4 shared-H", 3072, seed=27))
