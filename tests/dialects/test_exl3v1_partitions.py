"""`validate --tp N` on exl3-v1: b12x's partition_extents and the vLLM fork's plan_exl3_extent, each named with
its version. Neither planner ships in an installed release (b12x's is in its repository after 1.5.1, the fork's
in its source tree), so the checks are the planners' published examples and their invariants, with b12x 1.5.1's
own `validate_extent` judging every extent where it is installed."""

from __future__ import annotations

import json
import random

import pytest

from helpers import run_cli
from trellis_cli.dialects.exl3v1.partitions import (B12X_PLANNER, FORK_PLANNER, Refused, partition_extents,
                                                    plan_exl3_extent)
from trellis_cli.dialects.exl3v1.schema import Manifest
from trellis_cli.synth import SynthSpec


def manifest(slots: int, align: int, barriers=(), layers=(3, 4, 5, 6)) -> Manifest:
    return Manifest(codebook="mcg", num_experts=4, hidden=256, intermediate=32 * slots, num_slots=slots,
                    layer_indices=tuple(layers), structure="uniform", bits=3, pair_kinds=(),
                    intermediate_hadamard=False, per_expert_input_rotations=False, pre_block=None, post_block=None,
                    row_alignment=4096, extent_alignment=align, barriers=tuple(barriers))


# The examples computed with b12x's own partition_extents (docs/checkpoint-dialects.md cites them).
@pytest.mark.parametrize("slots, align, barriers, tp, want", [
    (64, 4, (), 4, [(0, 16), (16, 16), (32, 16), (48, 16)]),
    (64, 8, (), 3, [(0, 24), (24, 24), (48, 16)]),
    (64, 4, (32,), 3, [(0, 16), (16, 16), (32, 32)]),
    (72, 8, (), 2, [(0, 40), (40, 32)]),
])
def test_partition_extents_examples(slots, align, barriers, tp, want):
    assert partition_extents(manifest(slots, align, barriers), tp) == want


@pytest.mark.parametrize("slots, align, barriers, tp", [(64, 8, (), 16), (64, 4, (32,), 1), (64, 8, (4,), 2)])
def test_partition_extents_refusals(slots, align, barriers, tp):
    with pytest.raises(Refused):
        partition_extents(manifest(slots, align, barriers), tp)


def _b12x_validate_extent():
    """b12x 1.5.1's own extent rule, where it is installed."""
    try:
        from b12x.moe._shared.exl3_schema import Exl3Manifest
    except ImportError:
        return None

    def check(m: Manifest, first: int, count: int) -> None:
        doc = {"kind": "exl3-manifest", "schema": "exl3-v1", "codebook": "mcg", "codebook_seed": 0xCBAC1FED,
               "geometry": {"num_experts": 4, "hidden_size": 256, "intermediate_size": m.intermediate,
                            "slot_channels": 32, "num_slots": m.num_slots, "moe_layer_indices": [3]},
               "rates": {"structure": "uniform", "bits": 3},
               "hadamard": {"intermediate_hadamard": False, "per_expert_input_rotations": False},
               "layout": {"row_alignment": 4096, "extent_alignment_slots": m.extent_alignment,
                          "extent_barriers": list(m.barriers)},
               "layers": {"3": {"file": "x", "sha256": "0" * 64}}}
        Exl3Manifest.from_dict(doc).validate_extent(first, count)
    return check


def test_both_planners_cover_every_slot_once_with_legal_extents():
    """Random layouts and TP degrees: each planner's extents tile the slots in rank order, each one legal under
    b12x 1.5.1's validate_extent; where b12x gives the first half ceil(TP/2) ranks as the fork does, the fork's
    first layer is b12x's partition; later layers rotate ownership by one rank (two at TP 10)."""
    check = _b12x_validate_extent()
    rng = random.Random(56)
    fork_seen = 0
    for _ in range(300):
        align = rng.choice([1, 2, 4, 8])
        slots = align * 2 * rng.randint(1, 24)
        barriers = (slots // 2,) if rng.random() < 0.7 else tuple(sorted(rng.sample(range(align, slots, align),
                                                                                     rng.randint(0, 2))))
        m = manifest(slots, align, barriers)
        tp = rng.randint(1, 24)
        try:
            b12x = partition_extents(m, tp)
        except Refused:
            b12x = None
        if b12x is not None:
            assert sum(n for _, n in b12x) == slots and [a for a, _ in b12x] == [sum(n for _, n in b12x[:i])
                                                                                 for i in range(tp)]
            for first, count in b12x:
                if check is not None:
                    check(m, first, count)
        try:
            layers = [[plan_exl3_extent(m, li, tp, r) for r in range(tp)] for li in m.layer_indices]
        except Refused:
            continue
        fork_seen += 1
        step = 2 if tp == 10 else 1
        for position, extents in enumerate(layers):
            assert sorted(extents) == sorted(layers[0]) and sum(n for _, n in extents) == slots
            assert all(extents[(r + position * step) % tp] == layers[0][r] for r in range(tp))
            for first, count in extents:
                if check is not None:
                    check(m, first, count)
        assert b12x is not None
        if sum(1 for first, _ in b12x if first < slots // 2) == (tp + 1) // 2:  # the same ranks per half
            assert layers[0] == b12x
    assert fork_seen > 50


def test_the_planners_differ_where_the_issue_says():
    """TP 3 over 64 slots with alignment 8 and no barrier: b12x gives 24/24/16; the fork refuses (it needs the
    halfway barrier). With the barrier they agree on the layers the rotation brings back to the start (the first,
    then every TP-th), and at TP 10 not even on the first: b12x gives the first half 6 ranks, the fork 5."""
    assert [n for _, n in partition_extents(manifest(64, 8), 3)] == [24, 24, 16]
    with pytest.raises(Refused):
        plan_exl3_extent(manifest(64, 8), 3, 3, 0)
    m = manifest(64, 4, (32,))
    b12x = partition_extents(m, 3)
    fork = {li: [plan_exl3_extent(m, li, 3, r) for r in range(3)] for li in m.layer_indices}
    assert [li for li, ex in fork.items() if ex == b12x] == [3, 6]
    m = manifest(32, 1, (16,))
    assert [n for _, n in partition_extents(m, 10)] == [3, 3, 3, 3, 2, 2, 4, 4, 4, 4]
    assert [plan_exl3_extent(m, 3, 10, r)[1] for r in range(10)] == [4, 3, 3, 3, 3, 4, 3, 3, 3, 3]


def test_validate_tp_reports_both_planners(capsys, tmp_path):
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    spec = SynthSpec(hidden=256, intermediate=1024, experts=4, tp=1, layers=(3, 4), uniform_k=3, top_k=2)
    root = write_exl3v1_checkpoint(tmp_path / "v1", spec)
    code, out, _ = run_cli(capsys, "validate", str(root), "--tp", "4", "--json")
    parts = json.loads(out)["context"]["tp_partitions"]
    assert [p["planner"] for p in parts] == [B12X_PLANNER, FORK_PLANNER]
    assert all(p["version"] for p in parts)
    assert parts[0]["extents"] == [[0, 8], [8, 8], [16, 8], [24, 8]]
    assert parts[1]["refused"] and "barrier" in parts[1]["refused"]  # trellis writes no halfway barrier
    code, out, _ = run_cli(capsys, "validate", str(root), "--tp", "4")
    assert f"TP 4 extents by {B12X_PLANNER} (local-inference-lab/b12x@e14d41c4" in out
    assert f"TP 4 extents by {FORK_PLANNER} (local-inference-lab/vllm@174fe4d4" in out
    code, out, _ = run_cli(capsys, "validate", str(root), "--json")
    assert "tp_partitions" not in json.loads(out)["context"]
