"""`trellis bench --mixed-gap`: the uniform layers it builds, the interpolation and gap arithmetic, the report's
JSON and table, argument errors through the real CLI (no GPU needed), and the timed run (on a GPU only)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import cuda_available, requires_gpu
from helpers import run_cli, without_hint
from trellis_cli.bench.mixed_gap import (GapPlan, gap_layers, gap_pct, gap_report, gap_row, interpolate,
                                         interpolation_weights, plan_mixed_gap, tier_split)
from trellis_cli.bench.synthetic import Preset
from trellis_cli.bench.throughput import Timing, interleaved_order, touched
from trellis_cli.cli.bench_gap import print_mixed_gap

# The production shape's tiers and expert count at a size that builds in milliseconds on the CPU.
SMALL = Preset("small", 512, 256, 16, 4, "mcg", (12, 4), (3, 4), 1)


def run(argv, capsys) -> tuple[int, str, str]:
    return run_cli(capsys, *argv)


def timing(us: float) -> dict:
    return Timing(us, us - 1.0, us + 2.0, 100).as_dict()


def test_plan_for_the_production_preset_is_192_64_against_256_0_and_0_256():
    plan = plan_mixed_gap(None, "glm52-tp4", None)
    assert plan.partition == (192, 64) and plan.kept == [(0, 3), (1, 4)]
    assert plan.uniform_partition(0) == (256, 0) and plan.uniform_partition(1) == (0, 256)
    assert plan.weights == [0.75, 0.25] and plan.bpw == 3.25
    assert plan.description == "synthetic glm52-tp4 partition 192/64"
    other = plan_mixed_gap(None, "glm52-tp4-shared-h", "160/96")
    assert other.preset.shared_h and other.weights == [160 / 256, 96 / 256]


def test_uniform_layers_have_the_mixed_layers_shape_one_tier_each():
    plan = GapPlan(SMALL, (12, 4))
    (k3_label, k3), (k4_label, k4), (mixed_label, mixed) = gap_layers(plan, device="cpu", seed=5)
    assert (k3_label, k4_label, mixed_label) == ("K3", "K4", "mixed")
    tiles = (512 // 16) * (256 // 16)
    for pack, tier_k, counts in ((k3, [3], [16]), (k4, [4], [16]), (mixed, [3, 4], [12, 4])):
        assert pack.tier_k == tier_k
        assert [tuple(t.shape) for t in pack.tier_trellis] == [(n, 3, tiles, 16 * k) for n, k in zip(counts, tier_k)]
        assert sorted(pack.global_to_combined.tolist()) == list(range(16))  # every expert served, once
        assert (pack.descriptors >> 8).tolist() == sum(([t] * n for t, n in enumerate(counts)), [])
        for name in ("rot_intermediate", "gate_suh", "up_suh", "down_svh"):
            assert getattr(pack, name).shape == getattr(mixed, name).shape
        assert (pack.hidden, pack.intermediate, pack.codebook) == (512, 256, "mcg")
    every = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    b3, b4, bm = (touched(p, every)["bytes"] for p in (k3, k4, mixed))
    assert b3 < bm < b4
    assert bm * 16 == 12 * b3 + 4 * b4  # bytes are linear in K: the mixed layer sits on the uniform line


def test_tier_split_counts_touched_experts_per_tier():
    _, _, (_, mixed) = gap_layers(GapPlan(SMALL, (12, 4)), device="cpu", seed=5)
    tier_of = {g: int(mixed.descriptors[c]) >> 8 for g, c in enumerate(mixed.global_to_combined.tolist())}
    k4 = [g for g, t in tier_of.items() if t == 1]
    k3 = [g for g, t in tier_of.items() if t == 0]
    ids = torch.tensor([[k3[0], k3[1], k4[0], -1], [k3[0], k4[0], k4[1], 99]], dtype=torch.int32)
    assert tier_split(mixed, ids) == [2, 2]  # repeats and out-of-range ids touch nothing more
    assert tier_split(mixed, torch.tensor([[k3[2]]], dtype=torch.int32)) == [1, 0]


def test_interleaved_order_rotates_the_first_layer_and_times_each_once_per_round():
    assert interleaved_order(3, 4) == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (0, 1),
                                       (2, 2), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    assert interleaved_order(1, 3) == [(0, 0), (0, 1), (0, 2)]  # one set: plain back-to-back replays


def test_interpolation_is_the_partition_weighted_mean_and_gap_is_relative():
    t3, t4 = 100.0, 120.0
    weights = interpolation_weights((192, 64))
    assert interpolate([t3, t4], weights) == pytest.approx((192 * t3 + 64 * t4) / 256) == pytest.approx(105.0)
    assert gap_pct(107.1, 105.0) == pytest.approx(2.0)
    assert gap_pct(102.9, 105.0) == pytest.approx(-2.0)
    assert interpolation_weights([5, 3]) == [0.625, 0.375]
    with pytest.raises(ValueError):
        interpolation_weights([0, 0])


def test_gap_row_and_report_schema_round_trip_through_json():
    plan = plan_mixed_gap(None, "glm52-tp4", None)
    uniform = [{"k": 3, "experts": 8, "bytes": 3_000_000, "copies": 6, "fused": timing(100.0)},
               {"k": 4, "experts": 8, "bytes": 4_000_000, "copies": 5, "fused": timing(120.0)}]
    mixed = {"experts": 8, "bytes": 3_375_000, "copies": 6, "tier_experts": [5, 3], "fused": timing(107.0)}
    row = gap_row(1, uniform, mixed, plan.weights)
    assert row["interpolated_us"] == pytest.approx(105.0) and row["gap_pct"] == pytest.approx(100 * 2 / 105)
    assert row["touched_interpolated_us"] == pytest.approx(107.5)
    assert row["touched_gap_pct"] == pytest.approx(100 * -0.5 / 107.5)
    doc = json.loads(json.dumps(gap_report(plan, [row], cold=True, replays=100, copy_gbps=3900.0,
                                           l2_bytes=50 << 20)))
    assert doc["mode"] == "mixed-gap" and doc["preset"] == "glm52-tp4" and doc["partition"] == "192/64"
    assert doc["tiers"] == [{"k": 3, "experts": 192, "weight": 0.75}, {"k": 4, "experts": 64, "weight": 0.25}]
    assert doc["mixed_bpw"] == 3.25 and doc["cold"] is True and doc["replays"] == 100
    (r,) = doc["rows"]
    assert set(r) == {"m", "uniform", "mixed", "interpolated_us", "gap_pct", "touched_interpolated_us",
                      "touched_gap_pct"}
    assert [u["k"] for u in r["uniform"]] == [3, 4]
    assert set(r["mixed"]["fused"]) == {"median_us", "min_us", "max_us", "replays"}


def test_table_has_one_row_per_m_with_the_gap(capsys):
    plan = plan_mixed_gap(None, "glm52-tp4", None)
    rows = [gap_row(m, [{"k": 3, "experts": 8, "bytes": 1, "copies": 2, "fused": timing(100.0 * m)},
                        {"k": 4, "experts": 8, "bytes": 1, "copies": 2, "fused": timing(120.0 * m)}],
                    {"experts": 8, "bytes": 1, "copies": 2, "tier_experts": [6, 2], "fused": timing(107.1 * m)},
                    plan.weights) for m in (1, 8)]
    print_mixed_gap(gap_report(plan, rows, cold=True, replays=100, copy_gbps=1.0, l2_bytes=1), plan.description)
    out = capsys.readouterr().out
    assert "interpolated = (192·K3 + 64·K4)/256" in out and "3.25 bpw" in out
    assert "gap %" in out and "K3 µs" in out and "K4 µs" in out
    lines = [line for line in out.splitlines() if "+2.0" in line]
    assert len(lines) == 2 and "105.0" in lines[0] and "840.0" in lines[1]  # 8·105 interpolated at M=8


@pytest.mark.parametrize("argv, says", [
    (["bench", "--mixed-gap"], "--synthetic"),
    (["bench", "some/checkpoint", "--mixed-gap", "--synthetic", "glm52-tp4"], "not both"),
    (["bench", "--mixed-gap", "--synthetic", "glm52-tp4", "--smoke"], "--smoke"),
    (["bench", "--mixed-gap", "--synthetic", "nope"], "unknown synthetic preset"),
    (["bench", "--mixed-gap", "--synthetic", "glm52-tp4", "--partition", "256/0"], "at least two"),
    (["bench", "--mixed-gap", "--synthetic", "glm52-tp4", "--partition", "100/100"], "256 experts"),
    (["bench", "--mixed-gap", "--synthetic", "glm52-tp4", "--partition", "1/2/253"], "2 non-negative"),
    (["bench", "--mixed-gap", "--synthetic", "glm52-tp4", "--m", "0"], "--m"),
])
def test_bad_mixed_gap_arguments_are_usage_errors(argv, says, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    lines = without_hint(err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0]


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU path")
def test_mixed_gap_without_gpu_exits_4(capsys):
    code, out, err = run(["bench", "--synthetic", "glm52-tp4", "--mixed-gap", "--json"], capsys)
    assert code == 4 and out == "" and "GPU" in err


@requires_gpu
@pytest.mark.gpu
def test_mixed_gap_run_on_a_small_layer():
    from trellis_cli.bench.mixed_gap import run_mixed_gap
    from trellis_cli.kernel.abi import default_library

    result = run_mixed_gap(GapPlan(SMALL, (12, 4)), default_library(), [1, 64], cold=True, replays=100, seed=3)
    assert [r["m"] for r in result["rows"]] == [1, 64] and result["tiers"][0]["weight"] == 0.75
    for row in result["rows"]:
        uniform, mixed = row["uniform"], row["mixed"]
        assert [u["k"] for u in uniform] == [3, 4]
        assert all(u["experts"] == mixed["experts"] == sum(mixed["tier_experts"]) for u in uniform)
        assert uniform[0]["bytes"] < uniform[1]["bytes"] and all(u["copies"] >= 2 for u in uniform)
        for t in [u["fused"] for u in uniform] + [mixed["fused"]]:
            assert t["replays"] == 100 and 0 < t["min_us"] <= t["median_us"] <= t["max_us"]
        times = [u["fused"]["median_us"] for u in uniform]
        assert min(times) <= row["interpolated_us"] <= max(times)
        assert row["gap_pct"] == pytest.approx(gap_pct(mixed["fused"]["median_us"], row["interpolated_us"]))


@requires_gpu
@pytest.mark.gpu
@pytest.mark.slow
def test_cli_mixed_gap_production_shape(capsys):
    code, out, _ = run(["bench", "--synthetic", "glm52-tp4", "--mixed-gap", "--m", "1,64", "--json", "--warm"],
                       capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["mode"] == "mixed-gap" and doc["partition"] == "192/64" and doc["cold"] is False
    assert doc["environment"]["kernel"]["build_hash"] and doc["source"] == "synthetic glm52-tp4 partition 192/64"
    assert [r["m"] for r in doc["rows"]] == [1, 64]
    assert all(r["mixed"]["experts"] == 8 for r in doc["rows"][:1])
    code, out, _ = run(["bench", "--synthetic", "glm52-tp4", "--mixed-gap", "--m", "8", "--warm"], capsys)
    assert code == 0 and "gap %" in out and "interpolated = (192·K3 + 64·K4)/256" in out
