"""Synthetic TR3 checkpoints: files, keys, shapes, contract fields, reproducibility, sparse, errors, CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import run_cli
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header import read_local_header
from trellis_cli.synth import (
    NON_EXPERT_SHARD,
    SHARED_H_TENSOR_SCHEMA,
    TENSOR_SCHEMA,
    RandomTensors,
    SynthSpec,
    checkpoint_bytes,
    layer_bytes,
    preset,
    write_checkpoint,
)

PROJS = ("gate_proj", "up_proj", "down_proj")
MCG, MUL1 = -877912083, -2082680531


def tiny(**changes) -> SynthSpec:
    return dataclasses.replace(preset("tiny"), **changes)


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_json(path: Path):
    return json.loads(path.read_text())


def expected_keys(layer: int, experts: int, tp: int, shared_h: bool, marker: str | None = "mcg") -> set[str]:
    """The dialect's key set, spelled out independently of the writer."""
    keys = set()
    for e in range(experts):
        for p in PROJS:
            for r in range(tp):
                fields = ["trellis", "suh", "svh"] + ([marker] if marker else [])
                if shared_h:
                    fields.remove("svh" if p == "down_proj" else "suh")
                keys |= {f"model.layers.{layer}.mlp.experts.{e}.{p}.rank{r}.{f}" for f in fields}
    if shared_h:
        for p in PROJS:
            for r in range(tp):
                f = "svh" if p == "down_proj" else "suh"
                keys.add(f"model.layers.{layer}.mlp.experts.shared_h.{p}.rank{r}.{f}")
    return keys


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory) -> Path:
    spec = tiny(experts=16, partition=(11, 5), layers=(3, 4, 5), top_k=4, seed=7)
    return write_checkpoint(tmp_path_factory.mktemp("synth") / "ckpt", spec)


@pytest.fixture(scope="module")
def shared_h(tmp_path_factory) -> Path:
    spec = tiny(experts=16, partition=(11, 5), layers=(3, 4, 5), top_k=4, seed=7, rotation_layout="shared_h_v1")
    return write_checkpoint(tmp_path_factory.mktemp("synth") / "ckpt", spec)


def test_files_and_per_expert_key_set(per_expert):
    names = sorted(p.name for p in per_expert.iterdir())
    assert names == ["MANIFEST.sha256", "config.json", "model-layer-003.safetensors", "model-layer-004.safetensors",
                     "model-layer-005.safetensors", NON_EXPERT_SHARD, "model.safetensors.index.json", "tier_bitmap.json"]
    for layer in (3, 4, 5):
        tensors = load_shard(per_expert / f"model-layer-{layer:03d}.safetensors")
        assert set(tensors) == expected_keys(layer, 16, 2, shared_h=False)
        assert len(tensors) == 16 * 3 * 2 * 4  # the 12,288-per-layer count at this geometry


def test_byte_arithmetic_matches_headers(tmp_path, shared_h):
    for variant in (tiny(codebook="3inst"), tiny(rotation_layout="shared_h_v1", codebook="mul1")):
        out = write_checkpoint(tmp_path / variant.codebook, dataclasses.replace(variant, sparse=True))
        for layer in variant.layers:
            name = f"model-layer-{layer:03d}.safetensors"
            assert layer_bytes(variant, layer) == read_local_header(out / name, name).data_end
    index = read_json(shared_h / "model.safetensors.index.json")
    spec = tiny(experts=16, partition=(11, 5), layers=(3, 4, 5), top_k=4, seed=7, rotation_layout="shared_h_v1")
    assert index["metadata"]["total_size"] == checkpoint_bytes(spec)


def test_shared_h_key_set_and_rows(shared_h):
    tensors = load_shard(shared_h / "model-layer-004.safetensors")
    assert set(tensors) == expected_keys(4, 16, 2, shared_h=True)
    assert len(tensors) == 16 * 3 * 2 * 3 + 3 * 2  # the 9,228-per-layer count at this geometry
    for p in PROJS:
        for r in range(2):
            field = "svh" if p == "down_proj" else "suh"
            row = tensors[f"model.layers.4.mlp.experts.shared_h.{p}.rank{r}.{field}"]
            assert row.dtype == torch.float16 and tuple(row.shape) == (256,)
            assert (row != 0).all()


def test_shapes_follow_bitmap(per_expert):
    bitmap = read_json(per_expert / "tier_bitmap.json")
    h, i_rank = 256, 128
    for layer in ("3", "4", "5"):
        ks = bitmap[layer]["k"]
        tensors = load_shard(per_expert / f"model-layer-{int(layer):03d}.safetensors")
        for e, k in enumerate(ks):
            for r in range(2):
                pre = f"model.layers.{layer}.mlp.experts.{e}"
                for p in ("gate_proj", "up_proj"):
                    assert tuple(tensors[f"{pre}.{p}.rank{r}.trellis"].shape) == (h // 16, i_rank // 16, 16 * k)
                    assert tuple(tensors[f"{pre}.{p}.rank{r}.suh"].shape) == (h,)
                    assert tuple(tensors[f"{pre}.{p}.rank{r}.svh"].shape) == (i_rank,)
                assert tuple(tensors[f"{pre}.down_proj.rank{r}.trellis"].shape) == (i_rank // 16, h // 16, 16 * k)
                assert tuple(tensors[f"{pre}.down_proj.rank{r}.suh"].shape) == (i_rank,)
                assert tuple(tensors[f"{pre}.down_proj.rank{r}.svh"].shape) == (h,)
                for p in PROJS:
                    assert tensors[f"{pre}.{p}.rank{r}.trellis"].dtype == torch.int16
                    marker = tensors[f"{pre}.{p}.rank{r}.mcg"]
                    assert marker.dtype == torch.int32 and marker.shape == () and int(marker) == MCG


def test_partition_counts_interleave_and_differ_between_layers(per_expert):
    bitmap = read_json(per_expert / "tier_bitmap.json")
    assert set(bitmap) == {"3", "4", "5"}
    k4_sets = []
    for entry in bitmap.values():
        assert sorted(entry["k"]).count(3) == 11 and entry["k"].count(4) == 5
        assert entry["tail_tr3"] == list(range(16)) and entry["keep_nvfp4"] == []
        k4 = [e for e, k in enumerate(entry["k"]) if k == 4]
        assert k4 != list(range(5)) and k4 != list(range(11, 16))  # not a contiguous block
        k4_sets.append(k4)
    assert len({tuple(s) for s in k4_sets}) > 1


def test_config_contract(per_expert, shared_h):
    cfg = read_json(per_expert / "config.json")
    assert cfg["hidden_size"] == 256 and cfg["moe_intermediate_size"] == 256
    assert cfg["n_routed_experts"] == 16 and cfg["num_experts_per_tok"] == 4
    assert cfg["first_k_dense_replace"] == 3 and cfg["num_hidden_layers"] == 6
    tail = cfg["hybrid_tr3_tail"]
    assert {k: tail[k] for k in ("format", "bits", "k_values", "bits_per_expert", "codebook", "experts_per_layer",
                                 "moe_layers", "tensor_schema", "tp", "rotation_layout")} == {
        "format": "exl3-trellis", "bits": "mixed", "k_values": [3, 4], "bits_per_expert": "tier_bitmap.json:k",
        "codebook": "mcg", "experts_per_layer": 16, "moe_layers": [3, 5],
        "tensor_schema": "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}",
        "tp": 2, "rotation_layout": "per_expert_v1"}
    assert "shared_h_tensor_schema" not in tail and "trellis_bits_by_layer" not in tail
    assert tail["tensor_schema"] == TENSOR_SCHEMA
    assert cfg["quantization_config"] == {"quant_method": "exl3", "bits": round((11 * 3 + 5 * 4) / 16, 2),
                                          "codebook": "mcg"}
    shared = read_json(shared_h / "config.json")["hybrid_tr3_tail"]
    assert shared["rotation_layout"] == "shared_h_v1"
    assert shared["shared_h_tensor_schema"] == SHARED_H_TENSOR_SCHEMA
    assert SHARED_H_TENSOR_SCHEMA == "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}"


def test_index_and_manifest(per_expert):
    index = read_json(per_expert / "model.safetensors.index.json")
    total = 0
    for layer in (3, 4, 5):
        name = f"model-layer-{layer:03d}.safetensors"
        header = read_local_header(per_expert / name, name)
        assert {k for k, v in index["weight_map"].items() if v == name} == set(header.tensors)
        total += sum(t.nbytes for t in header.tensors.values())
    header = read_local_header(per_expert / NON_EXPERT_SHARD, NON_EXPERT_SHARD)  # the weights besides the experts
    assert {k for k, v in index["weight_map"].items() if v == NON_EXPERT_SHARD} == set(header.tensors)
    total += sum(t.nbytes for t in header.tensors.values())
    assert index["metadata"]["total_size"] == total == checkpoint_bytes(tiny(experts=16, partition=(11, 5),
                                                                             layers=(3, 4, 5), top_k=4, seed=7))
    lines = (per_expert / "MANIFEST.sha256").read_text().splitlines()
    listed = {}
    for line in lines:
        digest, name = line.split("  ")
        listed[name] = digest
    assert set(listed) == {p.name for p in per_expert.iterdir()} - {"MANIFEST.sha256"}
    for name, digest in listed.items():
        assert hashlib.sha256((per_expert / name).read_bytes()).hexdigest() == digest


def test_vectors_look_like_a_converters(per_expert):
    tensors = load_shard(per_expert / "model-layer-003.safetensors")
    suh = torch.cat([t.float() for k, t in tensors.items() if k.endswith(".suh")])
    svh = torch.cat([t.float() for k, t in tensors.items() if k.endswith(".svh")])
    assert (suh != 0).all() and 0.4 < (suh < 0).float().mean() < 0.6
    assert 0.005 < suh.abs().median() < 0.05
    assert abs(svh.abs().mean() - 1) < 0.01 and 0.4 < (svh < 0).float().mean() < 0.6
    trellis = torch.cat([t.flatten() for k, t in tensors.items() if k.endswith(".trellis")]).int()
    assert trellis.min() < -30000 and trellis.max() > 30000 and trellis.unique().numel() > 1000


def test_layouts_share_codes_and_intermediate_side_vectors(per_expert, shared_h):
    a = load_shard(per_expert / "model-layer-005.safetensors")
    b = load_shard(shared_h / "model-layer-005.safetensors")
    for key, tensor in b.items():
        if ".shared_h." not in key:
            assert torch.equal(tensor, a[key]), key


def test_reproducible_byte_for_byte(tmp_path):
    spec = tiny(seed=3)
    first = write_checkpoint(tmp_path / "a", spec)
    second = write_checkpoint(tmp_path / "b", spec)
    other = write_checkpoint(tmp_path / "c", tiny(seed=4))
    for name in os.listdir(first):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    shard = "model-layer-003.safetensors"
    assert (first / shard).read_bytes() != (other / shard).read_bytes()


def test_uniform_and_codebook_variants(tmp_path):
    out = write_checkpoint(tmp_path / "u", tiny(partition=None, uniform_k=3, codebook="mul1", bitmap_field="bits_per_expert"))
    tail = read_json(out / "config.json")["hybrid_tr3_tail"]
    assert tail["bits"] == 3 and tail["trellis_bits_by_layer"] == {"3": 3, "4": 3}
    assert "k_values" not in tail and "bits_per_expert" not in tail
    assert read_json(out / "tier_bitmap.json")["3"]["bits_per_expert"] == [3] * 8
    tensors = load_shard(out / "model-layer-003.safetensors")
    markers = [t for k, t in tensors.items() if k.endswith(".mul1")]
    assert len(markers) == 8 * 3 * 2 and all(int(m) == MUL1 for m in markers)
    assert not any(k.endswith(".mcg") for k in tensors)
    plain = write_checkpoint(tmp_path / "p", tiny(codebook="3inst", bitmap_field="bits_per_expert"))
    assert len(load_shard(plain / "model-layer-004.safetensors")) == 8 * 3 * 2 * 3
    assert read_json(plain / "config.json")["hybrid_tr3_tail"]["bits_per_expert"] == "tier_bitmap.json:bits_per_expert"


def test_explicit_bitmap(tmp_path):
    bitmap = {3: (4, 3, 3, 3, 3, 3, 3, 4), 4: (3, 5, 5, 3, 3, 3, 3, 3)}
    out = write_checkpoint(tmp_path / "b", tiny(partition=None, bitmap=bitmap))
    assert read_json(out / "config.json")["hybrid_tr3_tail"]["k_values"] == [3, 4, 5]
    header = read_local_header(out / "model-layer-004.safetensors", "x")
    assert header.tensors["model.layers.4.mlp.experts.1.down_proj.rank1.trellis"].shape == (8, 16, 80)


def test_sparse_headers_match_dense(tmp_path):
    dense = write_checkpoint(tmp_path / "d", tiny())
    sparse = write_checkpoint(tmp_path / "s", tiny(sparse=True))
    assert not (sparse / "MANIFEST.sha256").exists()
    for layer in (3, 4):
        name = f"model-layer-{layer:03d}.safetensors"
        assert (sparse / name).stat().st_size == (dense / name).stat().st_size
        assert read_local_header(sparse / name, name) == read_local_header(dense / name, name)
    assert (sparse / "config.json").read_bytes() == (dense / "config.json").read_bytes()


def test_sparse_production_geometry_headers(tmp_path):
    spec = dataclasses.replace(preset("glm52-tp4"), layers=(3, 4), sparse=True)
    out = write_checkpoint(tmp_path / "glm", spec)
    bitmap = read_json(out / "tier_bitmap.json")
    for layer in ("3", "4"):
        name = f"model-layer-{int(layer):03d}.safetensors"
        header = read_local_header(out / name, name)
        assert len(header.tensors) == 12288
        assert header.file_size == (out / name).stat().st_size == header.data_start + header.data_end
        assert (out / name).stat().st_blocks * 512 < 16 * 2**20  # holes, not data
        trellis_bytes = sum(t.nbytes for k, t in header.tensors.items() if k.endswith(".trellis"))
        assert trellis_bytes == 4 * 981_467_136  # 192/64 per rank per layer (format notes, section 1.6)
        ks = bitmap[layer]["k"]
        assert ks.count(3) == 192 and ks.count(4) == 64
        t = header.tensors[f"model.layers.{layer}.mlp.experts.17.gate_proj.rank3.trellis"]
        assert t.shape == (384, 32, 16 * ks[17])
        assert header.tensors[f"model.layers.{layer}.mlp.experts.17.down_proj.rank3.trellis"].shape == (32, 384, 16 * ks[17])
    cfg = read_json(out / "config.json")
    assert cfg["num_hidden_layers"] == 78 and cfg["hybrid_tr3_tail"]["tp"] == 4
    assert cfg["quantization_config"]["bits"] == 3.25


@pytest.mark.slow
def test_sparse_full_production_checkpoint(tmp_path):
    out = write_checkpoint(tmp_path / "glm", dataclasses.replace(preset("glm52-tp4"), sparse=True))
    shards = sorted(out.glob("model-layer-*.safetensors"))
    assert [s.name for s in shards] == [f"model-layer-{n:03d}.safetensors" for n in range(3, 79)]
    apparent = sum(s.stat().st_size for s in shards)
    assert 290e9 < apparent < 310e9
    index = read_json(out / "model.safetensors.index.json")
    assert len(index["weight_map"]) == 76 * 12288
    assert index["metadata"]["total_size"] == checkpoint_bytes(preset("glm52-tp4"))


class Exploding(RandomTensors):
    def linear(self, layer, expert, proj, rank, k):
        if layer == 4 and expert == 5:
            raise RuntimeError("boom")
        return super().linear(layer, expert, proj, rank, k)


class WrongShape(RandomTensors):
    def linear(self, layer, expert, proj, rank, k):
        tensors = super().linear(layer, expert, proj, rank, k)
        return {**tensors, "svh": tensors["svh"][:-16]}


def test_partial_output_removed_on_error(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        write_checkpoint(tmp_path / "out", tiny(), source=Exploding(tiny()))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckFailed, match=r"model-layer-003.safetensors: .*svh.*expected F16 \[128\]"):
        write_checkpoint(tmp_path / "out", tiny(), source=WrongShape(tiny()))
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_empty_output_unless_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    write_checkpoint(tmp_path / "out", tiny())  # an empty directory is fine
    with pytest.raises(UsageError, match="not empty"):
        write_checkpoint(tmp_path / "out", tiny(seed=1))
    write_checkpoint(tmp_path / "out", tiny(seed=1, layers=(7,)), overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == ["model-layer-007.safetensors",
                                                                                NON_EXPERT_SHARD]
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        write_checkpoint(tmp_path / "file", tiny())


@pytest.mark.parametrize("changes, message", [
    ({"hidden": 200}, "multiple of 128"),
    ({"intermediate": 384}, "per rank"),
    ({"partition": (5, 2)}, "summing to experts 8"),
    ({"uniform_k": 3}, "exactly one"),
    ({"layers": (4, 3)}, "ascending"),
    ({"layers": ()}, "non-empty"),
    ({"top_k": 9}, "exceeds experts"),
    ({"codebook": "fp8"}, "codebook"),
    ({"rotation_layout": "shared"}, "rotation_layout"),
    ({"partition": None, "bitmap": {3: (3,) * 8}}, "differ from layers"),
    ({"partition": None, "bitmap": {3: (3,) * 7, 4: (3,) * 8}}, "7 entries"),
    ({"partition": None, "uniform_k": 9}, "1..8"),
])
def test_bad_specs_are_usage_errors(changes, message):
    with pytest.raises(UsageError, match=message):
        tiny(**changes)


def test_cli_writes_and_reports_json(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "synth", str(tmp_path / "c"), "--shared-h", "--layers", "3-5", "--experts", "16",
                           "--partition", "12/4", "--seed", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["layers"] == [3, 4, 5] and doc["rotation_layout"] == "shared_h_v1" and doc["experts"] == 16
    assert doc["partitions"]["4"] == {"K3": 12, "K4": 4} and doc["tensors_per_layer"] == 16 * 2 * 9 + 6
    assert set(load_shard(tmp_path / "c" / "model-layer-005.safetensors")) == expected_keys(5, 16, 2, True)


def test_cli_bitmap_file(tmp_path, capsys):
    bitmap = tmp_path / "bitmap.json"
    bitmap.write_text(json.dumps({"6": {"k": [3, 4] * 4}, "8": [4, 4, 3, 3, 3, 3, 3, 3]}))
    code, out, _ = run_cli(capsys, "synth", str(tmp_path / "c"), "--bitmap", str(bitmap), "--json")
    assert code == 0 and json.loads(out)["layers"] == [6, 8]
    assert read_json(tmp_path / "c" / "tier_bitmap.json")["8"]["k"] == [4, 4, 3, 3, 3, 3, 3, 3]
    code, out, _ = run_cli(capsys, "synth", str(tmp_path / "d"), "--layers", "3,9", "--uniform", "4", "--json")
    assert code == 0 and json.loads(out)["bits"] == 4


@pytest.mark.parametrize("args, message", [
    (["--partition", "6/2", "--uniform", "3"], "at most one"),
    (["--layers", "3-x"], "--layers"),
    (["--layers", "5-3"], "backwards"),
    (["--partition", "6-2"], "--partition"),
    (["--experts", "16", "--partition", "6/2"], "pass --partition LOW/HIGH with LOW + HIGH = 16"),
    (["--hidden", "100"], "multiple of 128"),
    (["--bitmap", "missing.json"], "cannot read"),
    (["--uniform", "3", "--k-values", "3,5"], "--k-values"),
])
def test_cli_usage_errors_exit_2(tmp_path, capsys, args, message):
    code, out, err = run_cli(capsys, "synth", str(tmp_path / "c"), *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()


def test_cli_refuses_non_empty_out(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "synth", str(tmp_path / "c"))
    assert code == 2 and "not empty" in err
    assert (tmp_path / "c" / "keep.txt").read_text() == "mine"
    code, out, _ = run_cli(capsys, "synth", str(tmp_path / "c"), "--overwrite")
    assert code == 0 and "wrote" in out and not (tmp_path / "c" / "keep.txt").exists()
