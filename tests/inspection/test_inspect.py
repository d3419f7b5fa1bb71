"""`trellis inspect`: partitions, bytes, tier ranges and collapsed runs, in text, JSON and Markdown."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import run_cli
from trellis_cli.dialects import open_checkpoint
from trellis_cli.id_ranges import compact_ranges
from trellis_cli.inspect_report import build_inspect
from trellis_cli.synth import SynthSpec, preset, write_checkpoint


def test_compact_ranges():
    assert compact_ranges([0, 1, 2, 3, 4, 5, 9, 12, 13, 14, 40]) == "0-5,9,12-14,40"
    assert compact_ranges([7]) == "7" and compact_ranges([]) == ""
    assert compact_ranges([3, 1, 2, 2]) == "1-3"


@pytest.mark.parametrize("layout,tensors", [("per_expert_v1", 12_288), ("shared_h_v1", 9_228)])
def test_production_layer_numbers(tmp_path, layout, tensors):
    # One sparse GLM-5.2 TP4 layer at 192/64: the per-rank trellis bytes of the 3.25 bpw checkpoints.
    spec = replace(preset("glm52-tp4"), layers=(3,), sparse=True, rotation_layout=layout, num_hidden_layers=4,
                   mtp_layers=0)
    doc = build_inspect(open_checkpoint(write_checkpoint(tmp_path / "glm", spec)))
    row = doc["layers"][0]
    assert row["partition"] == "192/64" and row["bpw"] == 3.25 and row["k_values"] == [3, 4]
    assert row["trellis_bytes_per_rank"] == 981_467_136
    assert row["tensors"] == tensors and row["ranks"] == 4 and row["rotation"] == layout
    k3, k4 = expand(row["tiers"]["K3"]), expand(row["tiers"]["K4"])
    assert len(k3) == 192 and len(k4) == 64 and sorted(k3 + k4) == list(range(256))
    assert doc["totals"]["routed_bytes_per_rank"] == row["bytes_per_rank"]


def expand(ranges: str) -> list[int]:
    ids: list[int] = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids


def test_identical_layers_collapse_into_one_run(tmp_path):
    first = (3,) * 6 + (4,) * 2
    rest = (4, 3, 3, 4, 3, 3, 4, 3)
    spec = SynthSpec(hidden=128, intermediate=256, experts=8, tp=2, layers=(3, 4, 5, 6, 7), top_k=2,
                     bitmap={3: first, 4: rest, 5: rest, 6: rest, 7: rest}, sparse=True)
    doc = build_inspect(open_checkpoint(write_checkpoint(tmp_path / "ckpt", spec)))
    runs = doc["runs"]
    assert [r["layer_range"] for r in runs] == ["3", "4-7"]
    assert runs[0]["partition"] == "6/2" and runs[1]["partition"] == "5/3"
    assert runs[1]["tiers"] == {"K3": "1-2,4-5,7", "K4": "0,3,6"}


def test_text_output_on_the_bundled_sample(capsys):
    code, out, _ = run_cli(capsys, "inspect")
    assert code == 0
    assert "dialect: tr3/per_expert_v1" in out and "6/2 (K3/K4), 3.25 bpw" in out
    assert "K3: 0,2-5,7; K4: 1,6" in out and "routed experts per rank" in out


def test_json_and_markdown(capsys):
    code, out, _ = run_cli(capsys, "inspect", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dialect"] == "tr3/per_expert_v1" and doc["geometry"]["tp"] == 2
    assert [row["layer"] for row in doc["layers"]] == [3, 4] and doc["totals"]["tensors"] == 384 + 92  # experts, and the other weights
    code, out, _ = run_cli(capsys, "inspect", "--markdown", "--layers", "4")
    assert code == 0 and "| layers | partition |" in out and "| 4 | 4/4 (K3/K4) | 3.5 |" in out
    code, _, err = run_cli(capsys, "inspect", "--json", "--markdown")
    assert code == 2 and "exclusive" in err


def test_unknown_dialect_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, out, err = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 1 and out == "" and "no hybrid_tr3_tail" in err and "Traceback" not in err


def test_route_pack_is_described_by_its_manifest(tmp_path, capsys):
    from trellis_cli.sample import sample_path

    packed = tmp_path / "packed"
    assert run_cli(capsys, "repack", str(sample_path("tr3")), str(packed), "--json")[0] == 0
    code, out, _ = run_cli(capsys, "inspect", str(packed), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dialect"] == "trellis-route-pack"
    assert [layer["layer"] for layer in doc["route_pack"]["layers"]] == [3, 4]
    code, out, _ = run_cli(capsys, "inspect", str(packed))
    assert code == 0 and "repacked from:" in out and "(tr3/per_expert_v1)" in out
