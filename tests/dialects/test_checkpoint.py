"""The checkpoint model: dialect detection, parsing from headers only, and lazy tensor reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli, tiny_checkpoint, to_plain_exl3, to_r7
from trellis_cli.checkpoint import read_tensor
from trellis_cli.dialects import open_checkpoint
from trellis_cli.checkpoint.model import (
    DIALECT_EXL3,
    DIALECT_R7,
    DIALECT_TR3_PER_EXPERT,
    DIALECT_TR3_SHARED_H,
    MCG_MARKER,
)
from trellis_cli.checkpoint.names import parse_expert_name
from trellis_cli.checkpoint.tensors import read_rows
from trellis_cli.errors import CheckFailed, UnknownDialect
from trellis_cli.sample import sample_path


def test_bundled_sample_parses_as_tr3_with_shape_derived_partitions():
    ckpt = open_checkpoint(sample_path("tr3"))
    assert ckpt.dialect == DIALECT_TR3_PER_EXPERT and ckpt.tp == 2 and ckpt.codebook == "mcg"
    assert (ckpt.hidden, ckpt.intermediate, ckpt.num_experts) == (256, 256, 8)
    assert ckpt.parse_findings == []
    bitmap = json.loads((Path(sample_path("tr3")) / "tier_bitmap.json").read_text())
    for li, layer in ckpt.layers.items():
        assert layer.rank_sliced and layer.files == {f"model-layer-{li:03d}.safetensors"}
        assert [layer.expert_k(e) for e in range(8)] == bitmap[str(li)]["k"] == layer.declared_k
        assert sum(len(ids) for ids in layer.partition().values()) == 8


@pytest.mark.parametrize("layout,field,dialect", [("per_expert_v1", "k", DIALECT_TR3_PER_EXPERT),
                                                  ("shared_h_v1", "bits_per_expert", DIALECT_TR3_SHARED_H)])
def test_tr3_layouts_and_bitmap_fields(tmp_path, layout, field, dialect):
    ckpt = open_checkpoint(tiny_checkpoint(tmp_path, rotation_layout=layout, bitmap_field=field, partition=(5, 3)))
    assert ckpt.dialect == dialect and ckpt.rotation_layout == layout
    for layer in ckpt.layers.values():
        assert [len(ids) for ids in layer.partition().values()] == [5, 3]
        assert layer.declared_k == [layer.expert_k(e) for e in range(8)]
        assert bool(layer.shared_h) == (layout == "shared_h_v1")
        lin = layer.experts[0]["gate_proj"][1]
        assert (lin.suh is None) == (layout == "shared_h_v1") and lin.svh is not None and lin.codebook == "mcg"


def test_uniform_bits_declares_k_for_every_expert(tmp_path):
    ckpt = open_checkpoint(tiny_checkpoint(tmp_path, partition=None, uniform_k=4))
    for layer in ckpt.layers.values():
        assert layer.declared_k == [4] * 8 and layer.partition() == {4: list(range(8))}


def test_tail_tr3_fallback_means_all_k3(tmp_path):
    root = tiny_checkpoint(tmp_path, partition=None, uniform_k=3)
    config = json.loads((root / "config.json").read_text())
    hybrid = config["hybrid_tr3_tail"]
    hybrid.pop("trellis_bits_by_layer")
    hybrid.update(bits="mixed", k_values=[3, 4], bits_per_expert="tier_bitmap.json:k")
    (root / "config.json").write_text(json.dumps(config))
    bitmap = json.loads((root / "tier_bitmap.json").read_text())
    del bitmap["4"]["k"]  # only tail_tr3 left, covering every expert
    (root / "tier_bitmap.json").write_text(json.dumps(bitmap))
    ckpt = open_checkpoint(root)
    assert ckpt.layers[4].declared_k == [3] * 8
    assert ckpt.k_source[4] == "tier_bitmap.json:tail_tr3"


def test_plain_exllamav3_checkpoint(tmp_path):
    ckpt = open_checkpoint(to_plain_exl3(tiny_checkpoint(tmp_path, tp=1)))
    assert ckpt.dialect == DIALECT_EXL3 and ckpt.tp == 1
    layer = ckpt.layers[3]
    assert not layer.rank_sliced and set(layer.experts[0]["down_proj"]) == {0}
    assert layer.declared_projection_k[(1, "up_proj")] == layer.experts[1]["up_proj"][0].k


def test_r7_per_projection_maps(tmp_path):
    ckpt = open_checkpoint(to_r7(tiny_checkpoint(tmp_path)))
    assert ckpt.dialect == DIALECT_R7 and ckpt.tp == 2
    layer = ckpt.layers[4]
    assert len(layer.declared_projection_k) == 24
    assert layer.declared_projection_k[(2, "down_proj")] == layer.experts[2]["down_proj"][0].k


def test_unknown_dialect_names_what_was_found(tmp_path):
    root = tiny_checkpoint(tmp_path)
    config = json.loads((root / "config.json").read_text())
    config.pop("hybrid_tr3_tail")
    config["quantization_config"] = {"quant_method": "gptq"}
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownDialect, match="quant_method 'gptq'"):
        open_checkpoint(root)
    (root / "config.json").unlink()
    with pytest.raises(UnknownDialect, match="no config.json"):
        open_checkpoint(root)


def test_wrong_tr3_format_is_refused(tmp_path):
    root = tiny_checkpoint(tmp_path)
    config = json.loads((root / "config.json").read_text())
    config["hybrid_tr3_tail"]["format"] = "nvfp4"
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownDialect, match="exl3-trellis"):
        open_checkpoint(root)


def test_unparseable_shard_becomes_a_parse_finding(tmp_path):
    root = tiny_checkpoint(tmp_path)
    (root / "model-layer-004.safetensors").write_bytes(b"\x05\x00")
    ckpt = open_checkpoint(root)
    assert [f.code for f in ckpt.parse_findings] == ["file.truncated"]
    assert ckpt.layers[4].experts == {} and ckpt.layers[3].experts


def test_read_tensor_matches_safetensors_and_reads_rows(tmp_path):
    root = tiny_checkpoint(tmp_path)
    ckpt = open_checkpoint(root)
    reference = load_file(str(root / "model-layer-003.safetensors"))
    lin = ckpt.layers[3].experts[6]["down_proj"][1]
    for ref in (lin.trellis, lin.suh, lin.svh):
        assert torch.equal(read_tensor(ckpt, ref), reference[ref.name])
    assert int(read_tensor(ckpt, lin.mcg)) == MCG_MARKER
    rows = read_rows(ckpt, lin.trellis, 2, 4)
    assert torch.equal(rows, reference[lin.trellis.name][2:4])
    with pytest.raises(CheckFailed, match="outside"):
        read_rows(ckpt, lin.trellis, 3, 99)


def test_read_tensor_on_truncated_file_is_a_named_error(tmp_path):
    root = tiny_checkpoint(tmp_path)
    ckpt = open_checkpoint(root)
    lin = ckpt.layers[3].experts[7]["down_proj"][1]
    path = root / lin.trellis.file
    path.write_bytes(path.read_bytes()[: ckpt.headers[lin.trellis.file].data_start + 100])
    with pytest.raises(CheckFailed, match="run past the end"):
        read_tensor(ckpt, lin.trellis)


def test_name_grammar():
    p = parse_expert_name("model.layers.12.mlp.experts.255.down_proj.rank3.svh")
    assert (p.kind, p.layer, p.expert, p.projection, p.rank, p.field) == ("linear", 12, 255, "down_proj", 3, "svh")
    p = parse_expert_name("model.layers.3.mlp.experts.shared_h.up_proj.rank1.suh")
    assert (p.kind, p.projection, p.rank, p.field) == ("shared_h", "up_proj", 1, "suh")
    assert parse_expert_name("model.layers.3.mlp.experts.r7_shared.gate_up_suh").kind == "r7_shared"
    assert parse_expert_name("model.layers.3.mlp.experts.7.w2.trellis").projection == "down_proj"
    assert parse_expert_name("model.layers.3.mlp.experts.gate.weight").kind == "unparsed"
    assert parse_expert_name("model.layers.3.self_attn.q_proj.trellis") is None


def test_a_json_finding_code_comes_from_the_reader_not_the_message(tmp_path, capsys):
    """A malformed index whose name holds the word "limit" is unreadable, not too large: the code is the
    reader's, carried on the exception, not read back from a message that quotes the file name."""
    root = tiny_checkpoint(tmp_path)
    (root / "model.safetensors.index.json").unlink()
    (root / "limit.safetensors.index.json").write_text("{not json", encoding="utf-8")
    code, out, err = run_cli(capsys, "validate", str(root), "--json")
    found = [(f["code"], f["location"].get("file")) for f in json.loads(out)["findings"]]
    assert ("json.unreadable", "limit.safetensors.index.json") in found, (found, err)
    assert not any(c == "json.too-large" for c, _ in found)
    assert code == 1
