"""The kernel's contracts checked on the CPU: ctypes mirror == abi.h, LayerPack layout checks, arch names."""

from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest


from trellis_cli.bench.synthetic import Preset, synthetic_pack
from trellis_cli.errors import CheckFailed, GpuUnavailable
from trellis_cli.kernel import abi
from trellis_cli.kernel.build import kernel_source_dir, normalize_arch, source_hash
from trellis_cli.kernel.plan import check_pack_layout

SMALL = Preset("small", 256, 128, 8, 2, "mcg", (6, 2), (3, 4), 1)


def header_fields() -> list[str]:
    text = (kernel_source_dir() / "abi.h").read_text()
    body = text[text.index("typedef struct TrellisMoeArgs {"):text.index("} TrellisMoeArgs;")]
    return re.findall(r"^\s+(?:const )?\w+\*?\s+\*?(\w+)(?:\[\w+\])?;", body, flags=re.M)


def test_ctypes_struct_mirrors_abi_header_field_for_field():
    assert header_fields() == [name for name, _ in abi.TrellisMoeArgs._fields_]
    text = (kernel_source_dir() / "abi.h").read_text()
    assert f"#define TRELLIS_ABI_VERSION {abi.ABI_VERSION}" in text
    assert f"#define TRELLIS_MAX_TIERS {abi.MAX_TIERS}" in text
    # pointers first, then int32 scalars: no padding surprises between the two
    assert ctypes.sizeof(abi.TrellisMoeArgs) == 8 * (abi.MAX_TIERS + 19) + 4 * (2 * abi.MAX_TIERS + 20)


def test_synthetic_pack_passes_the_layout_check():
    pack = synthetic_pack(SMALL, device="cpu", seed=1)
    check_pack_layout(pack)
    assert pack.tier_size == [6, 2] and pack.tier_k == [3, 4]
    assert pack.tier_trellis[1].shape == (2, 3, (256 // 16) * (128 // 16), 64)
    descriptors = pack.descriptors.tolist()
    assert [d >> 8 for d in descriptors] == [0] * 6 + [1] * 2  # tier-ordered combined ids
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


def test_arch_names_and_source_hash():
    assert normalize_arch("sm_90") == normalize_arch("90") == normalize_arch("9.0") == "sm_90"
    assert normalize_arch("compute_80") == "sm_80"
    assert normalize_arch("sm_100") == "sm_100"
    with pytest.raises(GpuUnavailable):
        normalize_arch("sm_75")
    with pytest.raises(GpuUnavailable):
        normalize_arch("hopper")
    assert re.fullmatch(r"[0-9a-f]{64}", source_hash())
