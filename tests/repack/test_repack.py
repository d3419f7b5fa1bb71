"""Route pack: pack_layer tables, layer files, bit-exact round trips, verification of a route-pack directory."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import Interrupted, all_tensors, assert_same_tensors, interrupt_after
from trellis_cli import synth
from trellis_cli.dialects import open_checkpoint
from trellis_cli.errors import CheckFailed
from trellis_cli.dialects.routepack.layer_file import read_layer_pack, write_layer_pack
from trellis_cli.dialects.shard_pack import pack_layer
from trellis_cli.validate import run_validation
from trellis_cli.id_ranges import compact_ranges, expand_ranges
from trellis_cli.dialects.routepack.layout import SCHEMA
from trellis_cli.formats.layer_pack import split_descriptor
from trellis_cli import RepackOptions, run_repack
from trellis_cli.dialects.routepack.verify import describe_route_pack, verify_route_pack
from trellis_cli.sample import sample_path

TINY = synth.preset("tiny")
SPECS = {
    "mixed": TINY,
    "uniform": dataclasses.replace(TINY, partition=None, uniform_k=4),
    "shared_h": dataclasses.replace(TINY, rotation_layout="shared_h_v1", seed=3),
    "tp4": dataclasses.replace(TINY, intermediate=512, tp=4, partition=(5, 3), seed=1),
    "three_tiers": dataclasses.replace(TINY, partition=None, layers=(3,),
                                       bitmap={3: (3, 5, 4, 3, 5, 5, 4, 3)}, seed=2),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    made = {name: synth.write_checkpoint(root / name, spec) for name, spec in SPECS.items()}
    made["sample"] = Path(sample_path("tr3"))
    return made


def test_pack_layer_orders_tiers_and_gathers_rotations(sources):
    ckpt = open_checkpoint(sources["sample"])
    pack = pack_layer(ckpt, 3, 1)
    tiers = ckpt.layers[3].partition()
    assert pack.tier_k == sorted(tiers) and pack.tier_size == [len(ids) for ids in tiers.values()]
    order = [e for ids in tiers.values() for e in ids]  # tier-ordered, ascending id inside a tier
    assert [pack.global_to_combined[e].item() for e in order] == list(range(len(order)))
    f = safe_open(str(sources["sample"] / "model-layer-003.safetensors"), framework="pt")
    for c, expert in enumerate(order):
        tier, local = split_descriptor(pack.descriptors[c].item())
        assert pack.tier_trellis[tier].shape[1:3] == (3, (256 // 16) * (128 // 16))
        for p, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            prefix = f"model.layers.3.mlp.experts.{expert}.{proj}.rank1"
            trellis = f.get_tensor(f"{prefix}.trellis")
            assert torch.equal(pack.tier_trellis[tier][local, p], trellis.reshape(-1, trellis.shape[-1]))
            i_side, h_side = ("svh", "suh") if proj != "down_proj" else ("suh", "svh")
            assert torch.equal(pack.rot_intermediate[c, p], f.get_tensor(f"{prefix}.{i_side}"))
            table = (pack.gate_suh, pack.up_suh, pack.down_svh)[p]
            assert torch.equal(table[c], f.get_tensor(f"{prefix}.{h_side}"))


def test_layer_file_round_trip(sources, tmp_path):
    ckpt = open_checkpoint(sources["mixed"])
    pack = pack_layer(ckpt, 4, 0)
    write_layer_pack(tmp_path / "l.safetensors", pack)
    back = read_layer_pack(tmp_path / "l.safetensors", 4, 0)
    assert_same_tensors(pack.tensors(), back.tensors())
    with safe_open(str(tmp_path / "l.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["schema"] == SCHEMA and meta["rotation"] == "per_expert" and meta["tp"] == "2"
    with pytest.raises(CheckFailed, match="expected layer 3 rank 0"):
        read_layer_pack(tmp_path / "l.safetensors", 3, 0)


def test_shared_h_source_packs_one_row(sources):
    pack = pack_layer(open_checkpoint(sources["shared_h"]), 3, 0)
    assert pack.shared_h and pack.gate_suh.shape == (1, 256) and pack.down_svh.shape == (1, 256)


@pytest.mark.parametrize("name", ["sample", "mixed", "uniform", "shared_h", "tp4", "three_tiers"])
def test_round_trip_is_bit_exact(sources, tmp_path, name):
    packed, back = tmp_path / "packed", tmp_path / "back"
    result = run_repack(sources[name], packed, RepackOptions(jobs=2))
    assert result.files_written == len(list(packed.glob("layer-*.safetensors")))
    report = verify_route_pack(packed)
    assert report.ok, report.summary()
    run_repack(packed, back, RepackOptions(to="tr3"))
    assert_same_tensors(all_tensors(sources[name]), all_tensors(back))
    assert json.loads((back / "config.json").read_text()) == json.loads((sources[name] / "config.json").read_text())
    assert (back / "tier_bitmap.json").read_bytes() == (sources[name] / "tier_bitmap.json").read_bytes()
    assert open_checkpoint(back).dialect == open_checkpoint(sources[name]).dialect
    # The TR3 written back validates exactly like its source: no finding of its own (index total_size included).
    source_lines = {f.line() for f in run_validation(open_checkpoint(sources[name])).findings}
    back_lines = {f.line() for f in run_validation(open_checkpoint(back)).findings}
    assert back_lines == source_lines, sorted(back_lines ^ source_lines)


def test_manifest_describes_tiers_sources_and_files(sources, tmp_path):
    run_repack(sources["mixed"], tmp_path / "p", RepackOptions(layers="4", ranks="1"))
    doc = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert doc["schema"] == SCHEMA and doc["tp"] == 2 and doc["ranks"] == [1] and list(doc["layers"]) == ["4"]
    ks = TINY.expert_k(4)
    for tier in doc["layers"]["4"]["tiers"]:
        assert expand_ranges(tier["experts"]) == [e for e, k in enumerate(ks) if k == tier["k"]]
    assert set(doc["source"]["files"]) >= {"config.json", "model-layer-004.safetensors"}
    assert "model-layer-003.safetensors" not in doc["source"]["files"]
    assert sorted(n for n in doc["files"] if n.startswith("layer-")) == ["layer-004-rank-1.safetensors"]
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["trellis_repack"]["schema"] == SCHEMA
    info = describe_route_pack(tmp_path / "p")
    # manifest.json is counted too, as validate counts it
    assert info["layers"][0]["layer"] == 4 and info["tp"] == 2 and info["files"] == len(doc["files"]) + 1


def test_compact_ranges_round_trip():
    ids = [0, 1, 2, 5, 7, 8, 255]
    assert compact_ranges(ids) == "0-2,5,7-8,255" and expand_ranges(compact_ranges(ids)) == ids


def test_flipped_byte_in_any_output_file_fails_verification(sources, tmp_path):
    packed = tmp_path / "packed"
    run_repack(sources["mixed"], packed, RepackOptions())
    for path in sorted(p for p in packed.iterdir() if p.is_file()):
        broken = tmp_path / f"broken-{path.name}"
        shutil.copytree(packed, broken)
        data = bytearray((broken / path.name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (broken / path.name).write_bytes(bytes(data))
        report = verify_route_pack(broken)
        codes = {f.code for f in report.errors}
        assert not report.ok, path.name
        expected = "repack.manifest-integrity" if path.name == "manifest.json" else "repack.hash-mismatch"
        assert expected in codes or "repack.manifest-json" in codes, (path.name, codes)


def test_interrupted_repack_leaves_out_untouched_and_resumes(sources, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        interrupt_after(patch, 1)
        run_repack(sources["mixed"], out, RepackOptions())
    assert not out.exists() and (tmp_path / "out.partial").is_dir()
    result = run_repack(sources["mixed"], out, RepackOptions())
    assert result.files_resumed == 1 and result.files_written == 3
    assert verify_route_pack(out).ok and not (tmp_path / "out.partial").exists()


def test_resume_redoes_a_staged_file_that_changed(sources, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        interrupt_after(patch, 2)
        run_repack(sources["mixed"], out, RepackOptions())
    staged = sorted((tmp_path / "out.partial" / "tree").glob("layer-*.safetensors"))[0]
    data = bytearray(staged.read_bytes())
    data[-1] ^= 0xFF
    staged.write_bytes(bytes(data))
    result = run_repack(sources["mixed"], out, RepackOptions())
    assert result.files_resumed == 1 and result.files_written == 3 and verify_route_pack(out).ok


def test_free_space_is_checked_up_front(tmp_path):
    from trellis_cli.repack.staging import check_free_space

    check_free_space(tmp_path / "out", 1 << 20)
    with pytest.raises(CheckFailed, match="GB free on its filesystem, the repack needs"):
        check_free_space(tmp_path / "out", 1 << 62)


def test_repack_fails_closed_when_the_validator_cannot_be_imported(sources, tmp_path, monkeypatch):
    # Validation is part of the product: without the validator a repack refuses to start, it never goes
    # ahead unvalidated.
    monkeypatch.setitem(sys.modules, "trellis_cli.validate", None)  # `import trellis_cli.validate` fails
    out = tmp_path / "out"
    with pytest.raises(ImportError, match="trellis_cli.validate"):
        run_repack(sources["mixed"], out, RepackOptions())
    assert not out.exists() and not (tmp_path / "out.partial").exists()
