"""Repack's memory and disk bounds hold whatever non-expert tensors the source carries: a tensor larger than
the address space left to the process is streamed through, and the free-space check counts its bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from roundtrip import LAYOUTS, assert_same_tensors, non_expert_tensors, relayout
from helpers import run_cli
from trellis_cli import synth
from trellis_cli.stwriter import PlannedTensor, encode_header

ROOT = Path(__file__).resolve().parents[2]
BIG = "model.big_table.weight"
MARGIN = 128 << 20  # address space left above the process's own once everything is imported

# Imports everything a repack uses, then caps the address space at what it already maps plus MARGIN and
# runs the CLI in-process: any whole-tensor read or mapping of the big tensor fails with "cannot allocate".
LIMITED = """
import resource, sys
import numpy, safetensors, safetensors.torch, torch
import trellis_cli.cli.app, trellis_cli.dialects.tr3.convert, trellis_cli.dialects.tr3.driver, trellis_cli.dialects.routepack.verify
import trellis_cli.workflows
import trellis_cli.validate
size = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + int(sys.argv[1]), size + int(sys.argv[1])))
trellis_cli.cli.app.main(sys.argv[2:])
"""


def add_sparse_tensor(root: Path, shard: str, name: str, nbytes: int) -> None:
    """Append a U8 tensor of `nbytes` zeros to `shard` as a hole (no disk blocks), index and checksums kept."""
    from roundtrip import rewrite_checksums

    add_sparse_tensor_unhashed(root, shard, name, nbytes)
    rewrite_checksums(root)


def add_sparse_tensor_unhashed(root: Path, shard: str, name: str, nbytes: int) -> None:
    from safetensors import safe_open

    path = root / shard
    with safe_open(str(path), framework="pt") as f:
        tensors = {n: f.get_tensor(n).clone() for n in f.keys()}  # not views of the file rewritten below
    import torch

    from trellis_cli.stwriter import TORCH_TO_ST

    plan = [PlannedTensor(n, TORCH_TO_ST[str(t.dtype)], tuple(t.shape)) for n, t in tensors.items()]
    plan.append(PlannedTensor(name, "U8", (nbytes,)))
    header = encode_header(plan, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors.values():
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        f.truncate(len(header) + sum(p.nbytes for p in plan))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard
    index["metadata"]["total_size"] += nbytes
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def limited_repack(*args: str) -> subprocess.CompletedProcess:
    # One malloc arena: each further one reserves 64 MB of address space, which threads racing for the
    # allocator create at random, so a loaded machine could spend the margin on reservations alone.
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_ARENA_MAX="1")
    return subprocess.run([sys.executable, "-c", LIMITED, str(MARGIN), "repack", *args], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("memory") / "tiny", synth.preset("tiny"))


@pytest.mark.slow
def test_a_non_expert_tensor_larger_than_the_memory_left_is_streamed(tiny, tmp_path):
    src = relayout(tiny, tmp_path / "src", LAYOUTS["shard-per-layer"], non_expert_tensors(256))
    add_sparse_tensor(src, "model-layer-003.safetensors", BIG, 5 * MARGIN // 2)
    for args in ((str(src), str(tmp_path / "pack")), (str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")):
        done = limited_repack(*args)
        assert done.returncode == 0, done.stderr
    assert_same_tensors(src, tmp_path / "back")
    shutil.rmtree(tmp_path / "pack")
    done = limited_repack(str(src), str(tmp_path / "direct"), "--to", "tr3")
    assert done.returncode == 0, done.stderr
    assert_same_tensors(src, tmp_path / "direct")


def _out_bytes(root: Path, leave_out: tuple[str, ...]) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name not in leave_out)


def test_the_counted_bytes_include_non_expert_tensors(capsys, tiny, tmp_path):
    src = relayout(tiny, tmp_path / "src", LAYOUTS["shard-per-layer"], non_expert_tensors(256, vocab=4096))
    for to, out, small in (("route-pack", "pack", ("manifest.json", "config.json")),
                           ("tr3", "direct", ("config.json", "model.safetensors.index.json", "MANIFEST.sha256"))):
        code, stdout, err = run_cli(capsys, "repack", str(src), str(tmp_path / out), "--to", to, "--json")
        assert code == 0, err
        needed, held = json.loads(stdout)["bytes_needed"], _out_bytes(tmp_path / out, small)
        assert held - 64 * 1024 <= needed <= held, (to, needed, held)  # layer-file headers are not counted


@pytest.mark.slow
@pytest.mark.parametrize("to", ["route-pack", "tr3"])
def test_non_expert_bytes_beyond_the_free_space_are_refused_up_front(tiny, tmp_path, to):
    import resource

    src = relayout(tiny, tmp_path / "src", LAYOUTS["shard-per-layer"], non_expert_tensors(256))
    (src / "MANIFEST.sha256").unlink()  # a checksum over tens of GB of holes would take minutes
    add_sparse_tensor_unhashed(src, "model-layer-004.safetensors", BIG, shutil.disk_usage(tmp_path).free + (8 << 30))

    def cap_file_size() -> None:  # should repack start writing anyway, it stops at 64 MB per file
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))

    done = subprocess.run([sys.executable, "-m", "trellis_cli", "repack", str(src), str(tmp_path / "out"), "--to", to],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600,
                          preexec_fn=cap_file_size)
    assert done.returncode == 1 and "GB free on its filesystem, the repack needs" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
