"""Repack keeps every tensor and file of the source, whatever its shard layout, and refuses up front any
source file whose name collides with a name the output needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roundtrip import LAYOUTS, assert_same_files, assert_same_tensors, non_expert_tensors, relayout
from helpers import run_cli, error_line
from trellis_cli import synth


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("layouts") / "tiny", synth.preset("tiny"))


def _ok(capsys, *args: str) -> str:
    code, out, err = run_cli(capsys, *args)
    assert code == 0, out + err
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_tensor_and_file_comes_back_after_both_round_trips(capsys, tiny, tmp_path, layout):
    src = relayout(tiny, tmp_path / "src", LAYOUTS[layout], non_expert_tensors(256))
    _ok(capsys, "validate", "--checksums", str(src))
    _ok(capsys, "repack", str(src), str(tmp_path / "pack"))
    _ok(capsys, "validate", "--strict", str(tmp_path / "pack"))
    _ok(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")
    _ok(capsys, "repack", str(src), str(tmp_path / "direct"), "--to", "tr3")
    for out in ("back", "direct"):
        assert_same_tensors(src, tmp_path / out)
        assert_same_files(src, tmp_path / out)
        assert json.loads((tmp_path / out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
        _ok(capsys, "validate", "--checksums", str(tmp_path / out))


def _with_file(tiny: Path, target: Path, name: str, content: bytes | None = None) -> Path:
    """The shard-per-layer source plus one more file: bytes, or (None) a non-expert shard of one tensor."""
    import torch

    from roundtrip import rewrite_checksums
    from helpers import write_tensors as write_file

    src = relayout(tiny, target, LAYOUTS["shard-per-layer"], non_expert_tensors(256))
    (src / name).parent.mkdir(parents=True, exist_ok=True)
    if content is None:
        write_file(src / name, {"model.extra.weight": torch.arange(8, dtype=torch.float32)}, {"format": "pt"})
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.extra.weight"] = name
        index["metadata"]["total_size"] += 32
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        (src / name).write_bytes(content)
    rewrite_checksums(src)
    return src


@pytest.mark.parametrize("name", ["notes.partial", ".repack-state.json", "state.json", "tree/notes.txt",
                                  "model-layer-003.safetensors.tmp"])
def test_source_files_named_like_repack_bookkeeping_are_carried_through(capsys, tiny, tmp_path, name):
    src = _with_file(tiny, tmp_path / "src", name, b"the user's own bytes\n")
    _ok(capsys, "repack", str(src), str(tmp_path / "pack"))
    _ok(capsys, "validate", "--strict", str(tmp_path / "pack"))
    assert (tmp_path / "pack" / name).read_bytes() == b"the user's own bytes\n"
    _ok(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")
    _ok(capsys, "repack", str(src), str(tmp_path / "direct"), "--to", "tr3")
    for out in ("back", "direct"):
        assert_same_tensors(src, tmp_path / out)
        assert_same_files(src, tmp_path / out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "direct", "pack", "src"]


@pytest.mark.parametrize("name, content, output", [
    ("manifest.json", b'{"unrelated": true}\n', "the route pack's manifest.json"),
    ("extra/model-layer-003.safetensors", None, "the non-expert tensors of source file model-layer-003.safetensors"),
    ("layer-003-rank-0.safetensors", None, "named like a route-pack layer file"),
    ("layer-009-rank-5.safetensors", None, "named like a route-pack layer file"),
    ("layer-003-rank-0.safetensors.partial", b"x", "the temporary name of layer-003-rank-0.safetensors"),
    ("extra", b"a file where a folder goes", "the non-expert tensors of source file"),
], ids=["manifest", "extra-shard", "layer-file", "unplanned-layer-file", "temporary-name", "extra-file"])
def test_a_colliding_source_file_is_refused_before_any_work(capsys, tiny, tmp_path, name, content, output):
    src = _with_file(tiny, tmp_path / "src", name, content)
    code, out, err = run_cli(capsys, "repack", str(src), str(tmp_path / "pack"))
    assert code == 2 and f"source file {name}" in err and output in err and "Traceback" not in err, err
    assert err.count("error:") == 1 and error_line(err).startswith("error:"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT, no OUT.partial, no lock


def test_a_colliding_shard_temporary_name_is_refused_by_to_tr3(capsys, tiny, tmp_path):
    src = _with_file(tiny, tmp_path / "src", "model-layer-004.safetensors.partial", b"x")
    code, _, err = run_cli(capsys, "repack", str(src), str(tmp_path / "direct"), "--to", "tr3")
    assert code == 2 and "source file model-layer-004.safetensors.partial" in err, err
    assert "the temporary name of model-layer-004.safetensors" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_pack_of_some_layers_goes_back_to_a_tr3_checkpoint_that_validates(capsys, tiny, tmp_path):
    src = relayout(tiny, tmp_path / "src", LAYOUTS["one-shard"], non_expert_tensors(256))
    _ok(capsys, "repack", str(src), str(tmp_path / "pack"), "--layers", "3")
    _ok(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")
    _ok(capsys, "repack", str(src), str(tmp_path / "direct"), "--to", "tr3", "--layers", "4")
    for out, layer in (("back", 3), ("direct", 4)):
        code, stdout, err = run_cli(capsys, "validate", "--checksums", str(tmp_path / out))
        assert code == 0, stdout + err
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert config["hybrid_tr3_tail"]["moe_layers"] == [layer, layer]
        assert list(json.loads((tmp_path / out / "tier_bitmap.json").read_text())) == [str(layer)]
        kept = {n for n in json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
                if f".layers.{7 - layer}.mlp.experts." not in n}
        from roundtrip import stored_tensors

        assert set(stored_tensors(tmp_path / out)) == kept  # the other layer's experts only are left out


def test_layers_that_are_not_one_range_are_refused_by_to_tr3(capsys, tmp_path):
    import dataclasses

    src = synth.write_checkpoint(tmp_path / "src", dataclasses.replace(synth.preset("tiny"), layers=(3, 4, 5)))
    code, _, err = run_cli(capsys, "repack", str(src), str(tmp_path / "out"), "--to", "tr3", "--layers", "3,5")
    assert code == 2 and "[3, 5]" in err and "moe_layers" in err and "contiguous" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
