"""The kernel's contracts checked on the CPU: ctypes mirror == abi.h, LayerPack layout checks, arch names."""

from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest
import torch


from trellis_cli.bench.synthetic import Preset, synthetic_pack
from trellis_cli.errors import CheckFailed, GpuUnavailable
from trellis_cli.kernel import abi
from trellis_cli.kernel.build import kernel_source_dir, normalize_arch, source_hash
from trellis_cli.kernel.plan import check_pack_layout
from trellis_cli.formats.layer_pack import split_descriptor

SMALL = Preset("small", 256, 128, 8, 2, "mcg", (6, 2), (3, 4), 1)


def header_fields() -> list[str]:
    """The fields of TrellisMoeArgs in abi.h (the lab's own, with its flags, are checked in lab/tests)."""
    text = (kernel_source_dir() / "abi.h").read_text()
    body = text[text.index("typedef struct TrellisMoeArgs {"):text.index("} TrellisMoeArgs;")]
    return re.findall(r"^\s+(?:const )?\w+\*?\s+\*?(\w+)(?:\[\w+\])?;", body, flags=re.M)


def test_ctypes_struct_mirrors_abi_header_field_for_field():
    assert header_fields() == [name for name, _ in abi.TrellisMoeArgs._fields_]
    text = (kernel_source_dir() / "abi.h").read_text()
    assert f"#define TRELLIS_ABI_VERSION {abi.ABI_VERSION}" in text
    assert f"#define TRELLIS_MAX_TIERS {abi.MAX_TIERS}" in text
    # pointers first, then int32 scalars: no padding between the two, only at the end (to 8 bytes)
    packed = 8 * (abi.MAX_TIERS + 20) + 4 * (2 * abi.MAX_TIERS + 21)
    assert ctypes.sizeof(abi.TrellisMoeArgs) == -(-packed // 8) * 8


def test_synthetic_pack_passes_the_layout_check():
    pack = synthetic_pack(SMALL, device="cpu", seed=1)
    check_pack_layout(pack)
    assert pack.tier_size == [6, 2] and pack.tier_k == [3, 4]
    assert pack.tier_trellis[1].shape == (2, 3, (256 // 16) * (128 // 16), 64)
    descriptors = pack.descriptors.tolist()
    assert [split_descriptor(d)[0] for d in descriptors] == [0] * 6 + [1] * 2  # tier-ordered combined ids
    g2c = pack.global_to_combined.tolist()
    assert sorted(g2c) == list(range(8))


@pytest.mark.parametrize("field, bad, message", [
    ("rot_intermediate", lambda p: p.rot_intermediate.float(), "rot.intermediate"),
    ("gate_suh", lambda p: p.gate_suh[:, :128], "rot.gate_suh"),
    ("descriptors", lambda p: p.descriptors[:-1], "descriptors"),
    ("tier_trellis", lambda p: [p.tier_trellis[0][..., :40], p.tier_trellis[1]], "tier0.trellis"),
    ("global_to_combined", lambda p: p.global_to_combined.long(), "global_to_combined"),
])
def test_layout_check_names_the_bad_tensor(field, bad, message):
    pack = synthetic_pack(SMALL, device="cpu", seed=1)
    with pytest.raises(CheckFailed, match=message):
        check_pack_layout(dataclasses.replace(pack, **{field: bad(pack)}))


def test_shared_h_rows_are_accepted():
    pack = synthetic_pack(SMALL, device="cpu", seed=1)
    check_pack_layout(dataclasses.replace(pack, gate_suh=pack.gate_suh[:1], up_suh=pack.up_suh[:1],
                                          down_svh=pack.down_svh[:1]))


def test_shared_h_preset_has_one_row_per_hidden_table():
    from trellis_cli.bench.synthetic import PRESETS

    per_expert, shared = PRESETS["glm52-tp4"], PRESETS["glm52-tp4-shared-h"]
    assert dataclasses.replace(shared, name=per_expert.name, shared_h=False) == per_expert
    pack = synthetic_pack(dataclasses.replace(SMALL, shared_h=True), device="cpu", seed=1)
    check_pack_layout(pack)
    assert pack.shared_h and pack.rotation == "shared_h"
    assert [t.shape[0] for t in (pack.gate_suh, pack.up_suh, pack.down_svh)] == [1, 1, 1]
    assert pack.rot_intermediate.shape[0] == pack.num_combined  # intermediate-side rows stay per expert


def test_arch_names_and_source_hash():
    assert normalize_arch("sm_90") == normalize_arch("90") == normalize_arch("9.0") == "sm_90"
    assert normalize_arch("compute_80") == "sm_80"
    assert normalize_arch("sm_100") == "sm_100"
    with pytest.raises(GpuUnavailable):
        normalize_arch("sm_75")
    with pytest.raises(GpuUnavailable):
        normalize_arch("hopper")
    assert re.fullmatch(r"[0-9a-f]{64}", source_hash())


def expanded_col(col: int) -> int:
    """Python twin of kernels/decode.cuh expanded_col (the layout small-tile GEMMs read)."""
    return (col >> 4) * 32 + (col & 1) * 16 + ((col & 15) & ~1)


def test_expanded_columns_round_trip_through_plain_columns():
    from lab.kernel.oracle import plain_columns

    rows = torch.randn(3, 256, dtype=torch.float64)
    expanded = torch.zeros(3, 512, dtype=torch.float64)
    for col in range(256):  # every column twice, as the rotation and activation kernels store it
        expanded[:, expanded_col(col)] = rows[:, col]
        expanded[:, expanded_col(col) + 1] = rows[:, col]
    assert sorted(expanded_col(c) + d for c in range(256) for d in (0, 1)) == list(range(512))
    assert torch.equal(plain_columns(expanded), rows)


def test_workspace_width_follows_tile_size():
    from trellis_cli.kernel.plan import make_plan, workspace_shapes

    small, large = make_plan(4, 8, 6144, 512, 256), make_plan(4096, 8, 6144, 512, 256)
    assert (small.m_tile, large.m_tile) == (16, 128)
    assert workspace_shapes(small, 6144, 512)["xrot"][0][2] == 2 * 6144
    assert workspace_shapes(small, 6144, 512)["act"][0][1] == 2 * 512
    assert workspace_shapes(large, 6144, 512)["xrot"][0][2] == 6144


def test_large_tiles_start_earlier_on_wgmma():
    from trellis_cli.kernel.plan import LARGE_FROM_MMA_SYNC, LARGE_FROM_WGMMA, make_plan

    assert LARGE_FROM_WGMMA < LARGE_FROM_MMA_SYNC
    # glm52-tp4 at top-8: M=1024 is 32 routes per expert, M=512 16, M=2048 64.
    assert make_plan(1024, 8, 6144, 512, 256, wgmma=True).m_tile == 128
    assert make_plan(1024, 8, 6144, 512, 256).m_tile == 32
    assert make_plan(512, 8, 6144, 512, 256, wgmma=True).m_tile == 128
    assert make_plan(320, 8, 6144, 512, 256, wgmma=True).m_tile == 16
    assert make_plan(352, 8, 6144, 512, 256, wgmma=True).m_tile == 128
    assert make_plan(512, 8, 6144, 512, 256).m_tile == 32
    assert make_plan(2048, 8, 6144, 512, 256).m_tile == 128
    assert make_plan(2, 8, 6144, 512, 256, wgmma=True).direct  # small M is untouched
    assert make_plan(1024, 8, 6144, 384, 256, wgmma=True).m_tile == 32  # I % 256: mma.sync tiles


def test_hopper_builds_its_wgmma_target_and_other_archs_do_not():
    from trellis_cli.kernel.build import arch_flags

    assert arch_flags("sm_90") == ["-gencode=arch=compute_90a,code=sm_90a", "-DTRELLIS_WGMMA"]
    assert arch_flags("sm_80") == ["-gencode=arch=compute_80,code=sm_80"]
    assert arch_flags("sm_100") == ["-gencode=arch=compute_100,code=sm_100"]


@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_fc1_ranges_hold_at_least_six_chunks(m):
    from trellis_cli.kernel.plan import MIN_FC1_CHUNKS, make_plan

    plan = make_plan(m, 8, 6144, 512, 256)
    assert (6144 // 128) // plan.k_split >= MIN_FC1_CHUNKS
    assert make_plan(5, 4, 512, 256, 16).k_split == 1  # 4 chunks: never split below the minimum


@pytest.mark.parametrize("m", [1, 8, 64, 200, 512, 1024, 1700, 3072])
def test_plan_expects_routes_per_expert_of_the_layer(m):
    # A pack serving 64 of the layer's 256 experts (expert parallelism) sees a quarter of the routes over a
    # quarter of the experts: the same routes per expert, so the same tiles and, for ranges of the same
    # length, the same FC1 tail as the whole layer, by the measure the kernel's narrow/wide choice uses
    # (numel / E). Its fewer tiles may take more H ranges; the workspace is sized for E_c.
    from trellis_cli.kernel.plan import make_plan, routes_per_expert

    whole = make_plan(m, 8, 6144, 512, 256, wgmma=True, num_experts=256)
    part = make_plan(m, 8, 6144, 512, 64, wgmma=True, num_experts=256)
    assert (part.m_tile, part.direct) == (whole.m_tile, whole.direct)
    assert part.k_split >= whole.k_split
    same_ranges = make_plan(m, 8, 6144, 512, 64, wgmma=True, num_experts=256, k_split=whole.k_split)
    assert same_ranges.fc1_tail_split == whole.fc1_tail_split
    assert part.slot_capacity <= whole.slot_capacity and part.tile_capacity <= whole.tile_capacity
    assert make_plan(m, 8, 6144, 512, 256, wgmma=True) == whole  # E defaults to E_c
    assert routes_per_expert(m * 8, 256) == m / 32


def test_fc1_tail_follows_two_ctas_per_sm():
    # plan.choose_fc1_tail_split: where two FC1 CTAs share an SM (small and mid tiles, 128-row tiles on the
    # narrow wgmma kernels below 32 routes per expert) and the H ranges hold at least 24 chunks, the ranges
    # of the last half wave are cut in 4 or 2 pieces of at least 6; a partial-sum plane per piece.
    from trellis_cli.kernel.plan import make_plan, workspace_shapes

    glm = (6144, 512, 256)
    plans = [make_plan(m, 8, *glm, wgmma=True) for m in (1, 8, 16, 64, 512, 1016, 1024, 3072)]
    assert [p.k_split for p in plans] == [8, 4, 2, 1, 1, 1, 1, 1]
    assert [p.m_tile for p in plans] == [16, 16, 16, 16, 128, 128, 128, 128]
    # direct; 12-chunk ranges; small tiles; 128-row tiles below 32 routes per expert (M < 1024); above
    assert [p.fc1_tail_split for p in plans] == [1, 1, 4, 4, 4, 4, 1, 1]
    assert make_plan(512, 8, *glm).fc1_tail_split == 4  # 32-row tiles of mma.sync builds
    assert make_plan(64, 8, 3072, 512, 256, k_split=1).fc1_tail_split == 4  # 24 chunks: 4 x 6
    assert make_plan(64, 8, 4096, 512, 256, k_split=1).fc1_tail_split == 4  # 32 chunks: 4 x 8
    assert make_plan(64, 8, 2560, 512, 256, k_split=1).fc1_tail_split == 1  # 20 chunks
    assert make_plan(64, 8, 512, 256, 16).fc1_tail_split == 1  # 4 chunks
    assert make_plan(512, 8, 6144, 384, 256, wgmma=True).fc1_tail_split == 4  # I % 256: 32-row mma.sync tiles
    assert make_plan(4096, 8, *glm).fc1_tail_split == 1  # 128-row tiles on mma.sync
    assert workspace_shapes(plans[3], 6144, 512)["partial"][0][0] == 4
    assert workspace_shapes(plans[4], 6144, 512)["partial"][0][0] == 4
    assert workspace_shapes(plans[7], 6144, 512)["partial"][0][0] == 1


def test_fc1_tail_only_where_the_arch_holds_two_ctas_per_sm():
    # The small and mid FC1 hold 98-99 KB: two share an SM of sm_90 and sm_100 (228 KB), one fills an SM of
    # the 100 KB archs and of sm_80 (164 KB), whose plans take whole H ranges.
    from trellis_cli.kernel.arch_limits import limits_for_arch
    from trellis_cli.kernel.plan import make_plan

    glm = (6144, 512, 256)
    for arch, tail in (("sm_90", 4), ("sm_100", 4), ("sm_80", 1), ("sm_86", 1), ("sm_120", 1), ("sm_121", 1)):
        limits = limits_for_arch(arch)
        for m in (64, 512):
            assert make_plan(m, 8, *glm, limits=limits).fc1_tail_split == tail, (arch, m)
    hopper = limits_for_arch("sm_90")
    for m in (64, 512, 1024):  # the wgmma build's plans: as without limits
        assert make_plan(m, 8, *glm, wgmma=True, limits=hopper) == make_plan(m, 8, *glm, wgmma=True)
