"""`trellis diff`: conversions compare content-identical expert by expert, an edit is named, tier changes are
tier changes, the Hub's LFS hashes decide without downloads, and every difference reaches --json."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import restamp_exl3v1_hashes, run_cli, tiny_checkpoint
from hub_server import HubServer
from trellis_cli.sources import HEADER_WINDOW
from trellis_cli import RepackOptions, run_repack
from trellis_cli.dialects import open_checkpoint
from trellis_cli.diff.hashing import Hasher
from trellis_cli.diff.units import Span
from trellis_cli.synth import SynthSpec, write_checkpoint


@pytest.fixture(scope="module")
def family(exl3, tmp_path_factory) -> dict[str, Path]:
    """One set of codes in four forms: exl3-v1, TR3 at TP 2 made from it, and that TR3's route pack and exl3-v1."""
    root = tmp_path_factory.mktemp("family")
    run_repack(str(exl3), root / "tr3", RepackOptions(to="tr3", tp=2))
    run_repack(str(root / "tr3"), root / "pack", RepackOptions())
    run_repack(str(root / "tr3"), root / "exl3v1", RepackOptions(to="exl3-v1"))
    return {"exl3": exl3, "tr3": root / "tr3", "pack": root / "pack", "exl3v1": root / "exl3v1"}


def diff_json(capsys, *args) -> tuple[int, dict]:
    code, out, err = run_cli(capsys, "diff", *map(str, args), "--json")
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize("a, b", [("tr3", "pack"), ("tr3", "exl3v1"), ("tr3", "exl3"), ("pack", "exl3v1"),
                                  ("exl3", "exl3v1")])
def test_conversions_are_content_identical(capsys, family, a, b):
    code, doc = diff_json(capsys, family[a], family[b])
    assert code == 0 and doc["identical"] and doc["differences"] == []
    counts = doc["counts"]
    # every (layer, expert, projection, rank) in codes, intermediate and hidden vectors: 3 units each; two
    # exl3-v1 sides are read at the TP their slot layout and conversion note give, the others at TR3's 2
    ck = open_checkpoint(family["tr3"])
    tp = doc["compared_tp"]
    assert tp == 2 or {a, b} == {"exl3", "exl3v1"}
    linears = len(ck.layers) * ck.num_experts * 3 * tp
    assert counts["identical"] == 3 * linears and doc["methods"] == {"sha256": 3 * linears}
    assert doc["layers_compared"] == sorted(ck.layers)


def test_a_tr3_at_another_tp_is_resliced_and_compared(capsys, family, tmp_path):
    run_repack(str(family["exl3"]), tmp_path / "tp1", RepackOptions(to="tr3", tp=1))
    code, doc = diff_json(capsys, tmp_path / "tp1", family["tr3"])
    assert code == 0 and doc["compared_tp"] == 2
    assert {"key": "tp", "what": "checkpoint", "a": 1, "b": 2} in doc["structure"]


def _flip_byte(root: Path, tensor: str, offset: int) -> None:
    """Flip one byte at `offset` into `tensor`'s data, in whichever shard of `root` holds it."""
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if tensor not in f.keys():
                continue
        header_len = int.from_bytes(shard.read_bytes()[:8], "little")
        entry = json.loads(shard.read_bytes()[8:8 + header_len])[tensor]
        position = 8 + header_len + entry["data_offsets"][0] + offset
        data = bytearray(shard.read_bytes())
        data[position] ^= 0x5A
        shard.write_bytes(bytes(data))
        return
    raise AssertionError(f"{tensor} in no shard of {root}")


def test_one_byte_edit_in_one_expert_is_named(capsys, family, tmp_path):
    edited = Path(shutil.copytree(family["tr3"], tmp_path / "edited"))
    ck = open_checkpoint(family["tr3"])
    layer = max(ck.layers)
    _flip_byte(edited, f"model.layers.{layer}.mlp.experts.2.up_proj.rank1.trellis", 777)
    for other in ("tr3", "exl3v1", "pack"):  # the same unit, whatever dialect the other side is
        code, doc = diff_json(capsys, family[other], edited)
        assert code == 1 and not doc["identical"]
        (d,) = doc["differences"]
        assert (d["layer"], d["expert"], d["projection"], d["rank"], d["part"]) == (layer, 2, "up_proj", 1, "codes")
        assert d["status"] == "bytes" and d["method"] == "sha256" and d["a"]["sha256"] != d["b"]["sha256"]
        assert doc["counts"]["bytes"] == 1 and doc["counts"]["identical"] > 0
    code, out, _ = run_cli(capsys, "diff", str(family["exl3v1"]), str(edited))
    assert code == 1
    assert f"layer {layer}, bytes by sha256 (1):" in out and "expert 2 up_proj rank 1 codes" in out
    assert "different: 1 bytes" in out.splitlines()[-1]


def test_changed_tier_bitmap_is_reported_as_tier_changes(capsys, tmp_path):
    spec = SynthSpec(hidden=256, intermediate=512, experts=8, tp=2, layers=(3, 4), partition=(6, 2), top_k=2)
    before = write_checkpoint(tmp_path / "before", spec)
    bitmap = {layer: list(spec.expert_k(layer)) for layer in spec.layers}
    low = bitmap[4].index(3)
    bitmap[4][low] = 4  # one expert of layer 4: K3 -> K4
    after = write_checkpoint(tmp_path / "after", replace(spec, partition=None, bitmap=bitmap))
    code, doc = diff_json(capsys, before, after)
    assert code == 1
    layer4 = next(layer for layer in doc["layers"] if layer["layer"] == 4)
    assert layer4["tier_changes"] == [{"expert": low, "k_a": 3, "k_b": 4}]
    assert layer4["declared_changes"] == [{"expert": low, "k_a": 3, "k_b": 4}]
    assert layer4["partition_a"] == {"3": 6, "4": 2} and layer4["partition_b"] == {"3": 5, "4": 3}
    assert layer4["bpw_b"] > layer4["bpw_a"] and layer4["bytes_per_rank_b"][0] > layer4["bytes_per_rank_a"][0]
    assert all(not layer["tier_changes"] for layer in doc["layers"] if layer["layer"] != 4)
    # only that expert differs: its codes by shape (from headers), nothing of any other expert
    assert {d["expert"] for d in doc["differences"]} == {low}
    codes = [d for d in doc["differences"] if d["part"] == "codes"]
    assert len(codes) == 3 * 2 and all(d["status"] == "shape" and d["method"] == "header" for d in codes)
    assert layer4["methods"]["header"] == 6 and sum(layer4["methods"].values()) == sum(layer4["counts"].values())
    code, out, _ = run_cli(capsys, "diff", str(before), str(after))
    assert code == 1 and f"layer 4: 1 expert(s) K3→K4: {low}" in out and "1 expert(s) changed tier" in out


def test_layers_in_one_side_only_differ(capsys, tmp_path):
    a = tiny_checkpoint(tmp_path, "a", layers=(3, 4), partition=None, uniform_k=3)
    b = tiny_checkpoint(tmp_path, "b", layers=(3,), partition=None, uniform_k=3)
    code, doc = diff_json(capsys, a, b)
    assert code == 1 and doc["layers_only_a"] == [4] and doc["layers_compared"] == [3]
    code, doc = diff_json(capsys, a, b, "--layers", "3")
    assert code == 0 and doc["other_tensors_compared"] is False
    code, _, err = run_cli(capsys, "diff", str(a), str(b), "--layers", "9")
    assert code == 2 and "9" in err


def test_json_carries_every_difference_and_the_text_view_caps(capsys, tmp_path):
    a = tiny_checkpoint(tmp_path, "a")
    b = tiny_checkpoint(tmp_path, "b", seed=1)  # other random codes and vectors everywhere
    code, doc = diff_json(capsys, a, b)
    differing = sum(n for status, n in doc["counts"].items() if status != "identical")
    assert code == 1 and len(doc["differences"]) == differing > 20 and doc["counts"]["bytes"] > 20
    code, out, _ = run_cli(capsys, "diff", str(a), str(b))
    assert code == 1 and "more (--json lists all)" in out
    assert len([line for line in out.splitlines() if line.startswith("    expert ")]) < len(doc["differences"])
    code, out, _ = run_cli(capsys, "diff", str(a), str(b), "--markdown")
    assert code == 1 and "| layer | partition A |" in out and out.rstrip().endswith("**")


def test_same_files_decide_without_reading(capsys, tmp_path):
    a = tiny_checkpoint(tmp_path, "a")
    b = tmp_path / "b"
    b.mkdir()
    for path in a.iterdir():
        os.link(path, b / path.name)  # a hard-linked copy: the same inodes
    code, doc = diff_json(capsys, a, b)
    assert code == 0 and set(doc["methods"]) == {"same-file"}


def test_usage_and_unavailable_sources(capsys, tmp_path):
    a = tiny_checkpoint(tmp_path, "a")
    assert run_cli(capsys, "diff", str(a), str(a), "--json", "--markdown")[0] == 2
    code, _, err = run_cli(capsys, "diff", str(a), str(tmp_path / "missing"))
    assert code == 3 and "missing" in err


def test_streamed_hash_equals_hashlib_on_data_and_on_holes(tmp_path):
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
        f.seek(64 << 20)  # a hole of ~61 MiB, then a few bytes of data
        f.write(b"tail")

    class Dir:
        description = "test directory"

        def local_path(self, name, progress=None):
            return tmp_path / name

    raw = path.read_bytes()
    hasher = Hasher(Dir())
    spans = [Span("f.bin", 5, (2 << 20) + 11), Span("f.bin", 4 << 20, 60 << 20), Span("f.bin", (3 << 20) - 7, 64 << 20),
             Span("f.bin", (63 << 20), (64 << 20) + 4)]
    found = hasher.digests(spans)
    for span in spans:
        assert found[span] == hashlib.sha256(raw[span.begin:span.end]).hexdigest()


REPO_A, REPO_B = "org/tiny-a", "org/tiny-b"


def test_hub_pair_decided_by_lfs_hashes_downloads_no_shard(capsys, tmp_path):
    served = tiny_checkpoint(tmp_path, "served")
    with HubServer() as hub:
        first = hub.add_commit(REPO_A, served)
        hub.add_commit(REPO_B, served)
        hub.reset_counters()
        code, out, err = run_cli(capsys, "diff", f"{REPO_A}@{first}", REPO_B, "--endpoint", hub.endpoint,
                                 "--cache-dir", str(tmp_path / "cache"), "--json")
        assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0  # headers by ranged reads, no tensor data beyond
    assert code == 0, err
    doc = json.loads(out)
    assert doc["identical"] and set(doc["methods"]) == {"lfs-sha256"}
    assert doc["a"]["source"]["revision"] == first


def test_hub_revisions_download_only_the_changed_shard(capsys, tmp_path):
    served = tiny_checkpoint(tmp_path, "served")
    with HubServer() as hub:
        old = hub.add_commit(REPO_A, served)
        _flip_byte(served, "model.layers.4.mlp.experts.1.down_proj.rank0.trellis", 3)
        new = hub.add_commit(REPO_A, served)
        hub.reset_counters()
        code, out, err = run_cli(capsys, "diff", REPO_A, REPO_A, "--revision-a", old, "--revision-b", new,
                                 "--endpoint", hub.endpoint, "--cache-dir", str(tmp_path / "cache"), "--json")
        downloads = {path.rsplit("/", 1)[-1] for method, path, byte_range, _ in hub.requests
                     if method == "GET" and byte_range is None and path.endswith(".safetensors")}
    assert code == 1, err
    assert downloads == {"model-layer-004.safetensors"}
    doc = json.loads(out)
    (d,) = doc["differences"]
    assert (d["layer"], d["expert"], d["projection"], d["rank"], d["part"]) == (4, 1, "down_proj", 0, "codes")
    assert doc["methods"]["lfs-sha256"] > 0 and doc["methods"]["sha256"] > 0


@pytest.mark.slow
def test_production_shape_sparse_pair_names_the_expert_whose_k_changed(capsys, tmp_path):
    from trellis_cli.synth import preset

    spec = replace(preset("glm52-tp4"), sparse=True)
    a = write_checkpoint(tmp_path / "a", spec)
    bitmap = {layer: list(spec.expert_k(layer)) for layer in spec.layers}
    expert = bitmap[40].index(3)
    bitmap[40][expert] = 4
    b = write_checkpoint(tmp_path / "b", replace(spec, partition=None, bitmap=bitmap))
    code, doc = diff_json(capsys, a, b)
    assert code == 1
    changed = [(layer["layer"], layer["tier_changes"]) for layer in doc["layers"] if layer["tier_changes"]]
    assert changed == [(40, [{"expert": expert, "k_a": 3, "k_b": 4}])]
    assert {(d["layer"], d["expert"]) for d in doc["differences"]} == {(40, expert)}


def test_library_run_diff_returns_the_result_the_cli_prints(capsys, family):
    from trellis_cli import DiffResult, open_source, run_diff

    result = run_diff(open_checkpoint(open_source(str(family["tr3"]))), open_checkpoint(family["pack"]))
    assert isinstance(result, DiffResult) and result.identical
    _, doc = diff_json(capsys, family["tr3"], family["pack"])
    assert result.to_dict()["counts"] == doc["counts"] and result.summary() == doc["summary"]


def test_exl3v1_pair_on_the_hub_is_decided_by_lfs_hashes(capsys, exl3, tmp_path):
    with HubServer() as hub:
        hub.add_commit(REPO_A, exl3)
        hub.add_commit(REPO_B, exl3)
        hub.reset_counters()
        code, out, err = run_cli(capsys, "diff", REPO_A, REPO_B, "--endpoint", hub.endpoint,
                                 "--cache-dir", str(tmp_path / "cache"), "--json")
        assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0
    assert code == 0, err
    assert set(json.loads(out)["methods"]) == {"lfs-sha256"}


def test_exl3v1_edit_is_named_as_its_tr3_conversion_names_it(capsys, exl3, tmp_path):
    edited = Path(shutil.copytree(exl3, tmp_path / "edited"))
    _flip_byte(edited, "codes", 4099)  # in the first layer file: a byte of one expert's bundle
    restamp_exl3v1_hashes(edited)  # a re-published edit: conversions refuse bytes that fail their own hashes
    code, doc = diff_json(capsys, exl3, edited)
    assert code == 1
    (d,) = doc["differences"]
    assert d["part"] == "codes" and d["status"] == "bytes"
    tp = doc["compared_tp"]
    run_repack(str(exl3), tmp_path / "a", RepackOptions(to="tr3", tp=tp))
    run_repack(str(edited), tmp_path / "b", RepackOptions(to="tr3", tp=tp))
    _, reference_doc = diff_json(capsys, tmp_path / "a", tmp_path / "b")
    (r,) = reference_doc["differences"]
    assert [d[k] for k in ("layer", "expert", "projection", "rank")] == \
        [r[k] for k in ("layer", "expert", "projection", "rank")]


def test_damaged_inputs_are_named_errors_not_tracebacks(capsys, tmp_path):
    a = tiny_checkpoint(tmp_path, "a")
    b = Path(shutil.copytree(a, tmp_path / "b"))
    shard = sorted(b.glob("model-layer-*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    code, out, err = run_cli(capsys, "diff", str(a), str(b))
    assert code == 1 and f"{shard.name}: bytes [" in err and "run past the end" in err and "Traceback" not in err
    pack = tmp_path / "pack"
    run_repack(str(a), pack, RepackOptions())
    manifest = json.loads((pack / "manifest.json").read_text())
    first = next(iter(manifest["layers"]))
    manifest["layers"][first]["tiers"][0]["experts"] = "9-3"
    (pack / "manifest.json").write_text(json.dumps(manifest))
    run_repack(str(a), tmp_path / "pack2", RepackOptions())
    code, out, err = run_cli(capsys, "diff", str(tmp_path / "pack2"), str(pack))
    assert code == 1 and f"manifest.json layer {first} tier 0" in err and "backwards" in err


def test_plain_exl3_units_are_rank_0_and_an_edit_is_named(capsys, tmp_path):
    from helpers import to_plain_exl3

    a = to_plain_exl3(tiny_checkpoint(tmp_path, "a", tp=1))
    b = Path(shutil.copytree(a, tmp_path / "b"))
    _flip_byte(b, "model.layers.3.mlp.experts.5.gate_proj.suh", 1)
    code, doc = diff_json(capsys, a, b)
    assert code == 1 and doc["a"]["dialect"] == "exl3" and doc["compared_tp"] == 1
    (d,) = doc["differences"]
    assert (d["layer"], d["expert"], d["projection"], d["rank"], d["part"]) == (3, 5, "gate_proj", 0, "hidden")


def test_a_route_pack_manifest_naming_huge_tiers_is_refused_without_expanding_them(capsys, tmp_path):
    a = tiny_checkpoint(tmp_path, "a")
    run_repack(str(a), tmp_path / "pack", RepackOptions())
    run_repack(str(a), tmp_path / "hostile", RepackOptions())
    manifest = json.loads((tmp_path / "hostile" / "manifest.json").read_text())
    first = next(iter(manifest["layers"]))
    manifest["layers"][first]["tiers"][0]["experts"] = "0-99999999999"
    (tmp_path / "hostile" / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(capsys, "diff", str(tmp_path / "pack"), str(tmp_path / "hostile"))
    assert code == 1 and f"manifest.json layer {first} tier 0" in err
    manifest["layers"][first]["tiers"] = [{"k": 3, "experts": "0"}] * 100_000
    (tmp_path / "hostile" / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(capsys, "diff", str(tmp_path / "pack"), str(tmp_path / "hostile"))
    assert code == 1 and "100000 tiers" in err
