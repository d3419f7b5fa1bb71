"""The project's safetensors writer lays a file out as safetensors' own writer does, so that rewriting a
canonical file reproduces it byte for byte (a `repack --to tr3` round trip keeps the source's hashes)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import run_cli
from trellis_cli import synth
from helpers import write_tensors as write_file


def tensors_of_every_dtype() -> dict[str, torch.Tensor]:
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn, torch.int16,
              torch.uint16, torch.float16, torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64,
              torch.int64, torch.uint64]
    out = {}
    for i, dtype in enumerate(dtypes):
        for name in (f"b.{i}", f"a.{i}", f"model.layers.{i}.x\u00e9"):
            out[name] = torch.zeros(3, i + 1, dtype=dtype)
    out["scalar"] = torch.zeros((), dtype=torch.int32)
    return out


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_a_file_written_by_safetensors_is_rewritten_byte_for_byte(tmp_path, metadata):
    tensors = tensors_of_every_dtype()
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, str(theirs), metadata=metadata)
    with safe_open(str(theirs), "pt") as f:
        loaded = {name: f.get_tensor(name) for name in f.keys()}
    ours = write_file(tmp_path / "ours.safetensors", dict(reversed(list(loaded.items()))), metadata)
    assert ours.read_bytes() == theirs.read_bytes()


def test_a_tr3_round_trip_reproduces_the_source_files(capsys, tmp_path):
    source = synth.write_checkpoint(tmp_path / "src", synth.preset("tiny"))
    assert run_cli(capsys, "repack", str(source), str(tmp_path / "packed"))[0] == 0
    assert run_cli(capsys, "repack", str(tmp_path / "packed"), str(tmp_path / "back"), "--to", "tr3")[0] == 0
    for shard in sorted(source.glob("*.safetensors")):
        again = tmp_path / "back" / shard.name
        assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_a_header_in_safetensors_order_is_what_the_writer_plans(tmp_path):
    path = write_file(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.int16),
                                                     "a": torch.zeros(2, dtype=torch.float16),
                                                     "m": torch.zeros((), dtype=torch.int32)}, {"format": "pt"})
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert list(header) == ["__metadata__", "m", "a", "z"]
    assert [header[k]["data_offsets"] for k in ("m", "a", "z")] == [[0, 4], [4, 8], [8, 12]]
