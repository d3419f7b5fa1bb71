"""Repack against real processes: killed and resumed after the source changed, raced into one OUT, and
pointed at a symbolic link. Each case runs `python -m trellis_cli repack` as a subprocess."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roundtrip import assert_same_tensors
from helpers import run_cli, error_line
from trellis_cli import synth

ROOT = Path(__file__).resolve().parents[2]
# Big enough that a run lasts a few seconds (16 layer-rank files), small enough to write in about one.
SPEC = dataclasses.replace(synth.preset("tiny"), hidden=1024, intermediate=1024, experts=16,
                           layers=tuple(range(3, 11)), partition=(12, 4))


def repack(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "trellis_cli", "repack", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("races") / "src", SPEC)


def _kill_after_first_staged(proc: subprocess.Popen, state: Path) -> dict:
    """SIGKILL `proc` as soon as its stage records a finished file; that state, or skip if it finished first."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            doc = json.loads(state.read_text())
        except (OSError, ValueError):
            doc = {}
        if doc.get("files"):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return doc
        time.sleep(0.005)
    proc.communicate()
    pytest.skip("the repack finished before it could be interrupted")


def _flip_trellis_byte(shard: Path, name: str) -> None:
    """Change one byte of a tensor's data, keeping the file's size and mtime."""
    import struct

    before = shard.stat()
    with open(shard, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        begin = json.loads(f.read(n))[name]["data_offsets"][0]
        f.seek(8 + n + begin + 5)
        byte = f.read(1)
        f.seek(8 + n + begin + 5)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard.stat().st_size == before.st_size and shard.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.slow
@pytest.mark.parametrize("to", ["route-pack", "tr3"])
def test_resume_after_the_source_changed_redoes_what_came_from_it(capsys, source, tmp_path, to):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(source, src)
    out = tmp_path / "out"
    proc = repack(str(src), str(out), "--to", to, "--jobs", "1")
    staged = _kill_after_first_staged(proc, tmp_path / "out.partial" / "state.json")
    assert not out.exists()
    name = next(iter(staged["files"]))  # layer-LLL-rank-R.safetensors, or the TR3 shard model-layer-LLL.safetensors
    layer, rank = int(name.split("layer-")[1][:3]), int(name.split("rank-")[1][0]) if "rank-" in name else 0
    _flip_trellis_byte(src / f"model-layer-{layer:03d}.safetensors",
                       f"model.layers.{layer}.mlp.experts.0.gate_proj.rank{rank}.trellis")
    # A new version of the source, its MANIFEST.sha256 with it (a shard unlike its recorded hash is refused).
    from trellis_cli.integrity import CHECKSUM_MANIFEST, write_manifest

    write_manifest(src, [p.name for p in src.iterdir() if p.name != CHECKSUM_MANIFEST])
    code, stdout, err = run_cli(capsys, "repack", str(src), str(out), "--to", to, "--json")
    assert code == 0, err
    if to == "route-pack":
        assert run_cli(capsys, "repack", str(out), str(tmp_path / "back"), "--to", "tr3")[0] == 0
        assert_same_tensors(src, tmp_path / "back")
    else:
        assert_same_tensors(src, out)


@pytest.mark.slow
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_two_repacks_into_one_out_leave_one_complete_output(capsys, source, tmp_path, overwrite):
    out = tmp_path / "out"
    procs = [repack(str(source), str(out), "--jobs", "2", *overwrite),
             repack(str(source), str(out), "--experts-only", *overwrite)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert any(code == 0 for code, _, _ in results), results
    for code, _, err in results:
        if code != 0:  # the loser: one line, at once, naming why
            # one error line, the last (after the plain line saying the source is being opened)
            assert code == 2 and err.count("error:") == 1 and error_line(err).startswith("error:"), err
            assert "another trellis repack (pid" in err or "not empty" in err, err
    code, stdout, err = run_cli(capsys, "validate", "--strict", str(out))
    assert code == 0, stdout + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no OUT.partial, lock or replaced copy


def test_a_held_lock_fails_a_second_repack_at_once_naming_the_holder(source, tmp_path):
    from trellis_cli.repack.lock import StageLock
    from trellis_cli.repack.staging import stage_path

    out = tmp_path / "out"
    with StageLock(stage_path(out), out):
        proc = repack(str(source), str(out))
        code = proc.wait(timeout=120)
        _, err = proc.communicate()
    assert code == 2 and f"another trellis repack (pid {os.getpid()})" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_overwrite_refuses_an_out_that_is_a_symbolic_link(capsys, source, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / "out").symlink_to(target)
    code, _, err = run_cli(capsys, "repack", str(source), str(tmp_path / "out"), "--overwrite", "--layers", "3")
    assert code == 2 and "symbolic link" in err and "Traceback" not in err, err
    assert (target / "keep.txt").read_text() == "mine" and (tmp_path / "out").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out"]
