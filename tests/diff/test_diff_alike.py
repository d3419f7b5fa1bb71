"""diff of a checkpoint against a copy whose headers and other files are byte for byte the same: one model for both
sides (`_alike`), units in holes on both sides decided without hashing, and the same document as two openings
compared unit by unit."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import replace

import numpy as np
import pytest

from corrupt import rewrite_header
from trellis_cli.dialects import open_checkpoint
from trellis_cli.diff.hashing import Hasher
from trellis_cli.diff.run import _alike, diff_sources, run_diff
from trellis_cli.sources import LocalSource
from trellis_cli.synth import preset, write_checkpoint


def checkpoint(tmp_path, sparse):
    return write_checkpoint(tmp_path / "a", replace(preset("tiny"), sparse=sparse))


def overwrite(root, tensor, data=b"\x5a" * 16):
    """Overwrite the first bytes of one tensor's data, leaving every header as it is."""
    for shard in root.glob("*.safetensors"):
        with open(shard, "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            if tensor in header:
                f.seek(8 + n + header[tensor]["data_offsets"][0])
                f.write(data)
                return
    raise AssertionError(tensor)


def copy(root, to):
    """A copy that keeps the holes of a sparse checkpoint (as `cp --sparse=always` makes it)."""
    to.mkdir()
    for path in root.iterdir():
        data = path.read_bytes()
        with open(to / path.name, "wb") as f:
            for at in range(0, len(data), 4096):
                block = data[at:at + 4096]
                if block.count(0) != len(block):
                    f.seek(at)
                    f.write(block)
            f.truncate(len(data))
    return to


def documents(a, b):
    both = json.dumps(diff_sources(a, b).to_dict(), sort_keys=True)
    apart = json.dumps(run_diff(open_checkpoint(a), open_checkpoint(b)).to_dict(), sort_keys=True)
    return both, apart


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("changed", [[], ["model.layers.4.mlp.experts.1.up_proj.rank1.trellis"],
                                     ["model.layers.3.mlp.experts.0.down_proj.rank0.suh", "model.norm.weight"]])
def test_a_copy_with_other_bytes_is_one_model_and_the_same_answer(tmp_path, sparse, changed):
    a = checkpoint(tmp_path, sparse)
    b = copy(a, tmp_path / "b")
    for tensor in changed:
        overwrite(b, tensor)
    assert _alike(open_checkpoint(a), b) is not None
    if sparse:  # holes on both sides, decided without hashing
        end = (b / "model-layer-003.safetensors").stat().st_size
        assert Hasher(LocalSource(b)).holes("model-layer-003.safetensors", np.array([end - 1]), np.array([end])).all()
    both, apart = documents(a, b)
    assert both == apart
    assert json.loads(both)["counts"]["bytes"] == len(changed)


def test_the_same_directory_is_one_model(tmp_path):
    a = checkpoint(tmp_path, False)
    both, apart = documents(a, a)
    assert both == apart and json.loads(both)["methods"] == {"same-file": json.loads(both)["counts"]["identical"]}


@pytest.mark.parametrize("edit", ["header", "config", "extra file", "size"])
def test_a_copy_that_differs_where_the_opening_reads_is_opened_in_full(tmp_path, edit):
    a = checkpoint(tmp_path, True)
    b = copy(a, tmp_path / "b")
    shard = sorted(b.glob("model-layer-*.safetensors"))[0]
    if edit == "header":
        rewrite_header(shard, lambda h: h[next(n for n in h if n.endswith(".suh"))].__setitem__("dtype", "BF16"))
    elif edit == "config":
        config = json.loads((b / "config.json").read_text())
        config["note"] = "x"
        (b / "config.json").write_text(json.dumps(config))
    elif edit == "extra file":
        (b / "README.md").write_text("another file")
    else:
        with open(shard, "ab") as f:
            f.write(b"\0")
    assert _alike(open_checkpoint(a), b) is None
    both, apart = documents(a, b)
    assert both == apart


def test_a_link_leaving_the_copy_is_opened_in_full(tmp_path):
    a = checkpoint(tmp_path, True)
    b = copy(a, tmp_path / "b")
    shard = sorted(b.glob("model-layer-*.safetensors"))[0]
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    os.symlink(outside, shard)
    assert _alike(open_checkpoint(a), b) is None


def test_a_container_that_reads_tensor_data_when_opened_is_opened_in_full(tmp_path):
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    a = write_exl3v1_checkpoint(tmp_path / "a", preset("tiny"))
    b = copy(a, tmp_path / "b")
    assert _alike(open_checkpoint(a), b) is None
    both, apart = documents(a, b)
    assert both == apart
