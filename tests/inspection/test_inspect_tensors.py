"""`trellis inspect --tensors`: every tensor with dtype, shape, bytes, and K / bpw of EXL3 codes, from headers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from helpers import run_cli, tiny_checkpoint
from hub_server import HubServer
from trellis_cli.sources import HEADER_WINDOW
from trellis_cli import RepackOptions, run_repack


def listing(capsys, *args) -> dict:
    code, out, err = run_cli(capsys, "inspect", *map(str, args), "--tensors", "--json")
    assert code == 0, err
    return json.loads(out)


def reference(root: Path) -> dict[tuple[str, str], tuple[str, list[int], int]]:
    """Every tensor as safetensors itself reads it: (file, name) -> (dtype, shape, bytes)."""
    out = {}
    for path in sorted(root.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                dtype = {"torch.int16": "I16", "torch.float16": "F16", "torch.int32": "I32",
                         "torch.uint8": "U8", "torch.bfloat16": "BF16", "torch.float32": "F32"}[str(t.dtype)]
                out[path.relative_to(root).as_posix(), name] = (dtype, list(t.shape), t.numel() * t.element_size())
    return out


@pytest.fixture(scope="module")
def tr3(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tensors"), "tr3")


def test_every_tensor_of_a_tr3_is_listed_with_k_and_bpw(capsys, tr3):
    doc = listing(capsys, tr3)
    rows = {(r["file"], r["name"]): r for r in doc["tensors"]}
    assert {key: (r["dtype"], r["shape"], r["bytes"]) for key, r in rows.items()} == reference(tr3)
    bitmap = json.loads((tr3 / "tier_bitmap.json").read_text())
    for (_, name), r in rows.items():
        if name.endswith(".trellis"):
            layer, expert = int(name.split(".")[2]), int(name.split(".")[5])
            assert r["k"] == bitmap[str(layer)]["k"][expert] == r["bpw"] and r["layer"] == layer
        else:
            assert r["k"] is None and r["bpw"] is None
    assert doc["totals"]["tensors"] == len(rows) and doc["totals"]["bytes"] == sum(r["bytes"] for r in rows.values())
    for t in doc["layers"]:
        mine = [r for r in rows.values() if r["layer"] == t["layer"]]
        assert t["tensors"] == len(mine) and t["bytes"] == sum(r["bytes"] for r in mine)


def test_route_pack_slabs_carry_their_tier_k(capsys, tr3, tmp_path):
    run_repack(str(tr3), tmp_path / "pack", RepackOptions())
    doc = listing(capsys, tmp_path / "pack")
    manifest = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    rows = doc["tensors"]
    assert {(r["file"], r["name"]): (r["dtype"], r["shape"], r["bytes"]) for r in rows} == reference(tmp_path / "pack")
    for r in rows:
        if r["name"].startswith("tier") and r["name"].endswith(".trellis"):
            tier = int(r["name"][4:].split(".")[0])
            assert r["k"] == manifest["layers"][str(r["layer"])]["tiers"][tier]["k"]


def test_exl3v1_codes_bpw_is_bytes_over_weights(capsys, exl3):
    doc = listing(capsys, exl3)
    manifest = json.loads((exl3 / "exl3-manifest.json").read_text())
    g = manifest["geometry"]
    weights = g["num_experts"] * 3 * g["hidden_size"] * g["intermediate_size"]
    codes = [r for r in doc["tensors"] if r["name"] == "codes"]
    assert len(codes) == len(manifest["layers"])
    for r in codes:
        assert r["k"] is None and r["bpw"] == round(r["bytes"] * 8 / weights, 4)
        assert manifest["layers"][str(r["layer"])]["file"] == r["file"]


def test_markdown_has_one_table_per_layer_and_totals(capsys, tr3):
    code, out, _ = run_cli(capsys, "inspect", str(tr3), "--tensors", "--markdown")
    assert code == 0
    layers = sorted({r["layer"] for r in listing(capsys, tr3)["tensors"] if r["layer"] is not None})
    headings = [line for line in out.splitlines() if line.startswith("## ")]
    # the tiny preset writes the weights besides the experts too: they get their own table
    assert headings == [f"## Layer {layer}" for layer in layers] + ["## Tensors outside the MoE layers", "## Totals"]


def test_layers_select_and_absent_layers_are_usage_errors(capsys, tr3):
    doc = listing(capsys, tr3, "--layers", "4")
    assert doc["tensors"] and {r["layer"] for r in doc["tensors"]} == {4}
    code, _, err = run_cli(capsys, "inspect", str(tr3), "--tensors", "--layers", "99")
    assert code == 2 and "99" in err
    code, out, _ = run_cli(capsys, "inspect", str(tr3), "--tensors")
    assert code == 0 and out.splitlines()[-1].startswith("total: ")


def test_hub_listing_reads_headers_only(capsys, tr3, tmp_path):
    with HubServer() as hub:
        hub.add_commit("org/tiny", tr3)
        code, out, err = run_cli(capsys, "inspect", "org/tiny", "--tensors", "--json", "--endpoint", hub.endpoint,
                                 "--cache-dir", str(tmp_path / "cache"))
        assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0
    assert code == 0, err
    assert len(json.loads(out)["tensors"]) == len(reference(tr3))
