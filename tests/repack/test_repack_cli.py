"""`trellis repack` on the command line: exit codes, one-line refusals, JSON summary, selections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli  # also imported from here by tests written before helpers.py
from trellis_cli import synth


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("cli") / "src", synth.preset("tiny"))


def test_repack_json_summary_and_selection(capsys, source, tmp_path):
    code, out, _ = run_cli(capsys, "repack", str(source), str(tmp_path / "o"), "--layers", "3", "--ranks", "0,1",
                           "--jobs", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["files_written"] == 2 and doc["to"] == "route-pack"
    assert sorted(p.name for p in (tmp_path / "o").glob("layer-*")) == [
        "layer-003-rank-0.safetensors", "layer-003-rank-1.safetensors"]


def test_refuses_non_empty_out_and_writing_into_the_source(capsys, source, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    code, out, err = run_cli(capsys, "repack", str(source), str(tmp_path / "full"))
    assert code == 2 and "not empty" in err and "--overwrite" in err and out == ""
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    code, _, err = run_cli(capsys, "repack", str(source), str(source / "packed"))
    assert code == 2 and "refusing to write into the source" in err
    code, _, err = run_cli(capsys, "repack", str(source), str(tmp_path / "full"), "--overwrite")
    assert code == 0 and not (tmp_path / "full" / "keep.txt").exists()


def test_bad_selection_and_inexact_conversions_are_refused(capsys, source, tmp_path):
    code, _, err = run_cli(capsys, "repack", str(source), str(tmp_path / "o"), "--layers", "9")
    assert code == 2 and "--layers" in err and "[9]" in err
    code, _, err = run_cli(capsys, "repack", str(source), str(tmp_path / "o"), "--tp", "1")
    assert code == 1 and "not exact" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "repack", str(source), str(tmp_path / "o"), "--shared-h")
    assert code == 1 and "differs from expert" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_route_pack_back_to_tr3(capsys, source, tmp_path):
    assert run_cli(capsys, "repack", str(source), str(tmp_path / "p"))[0] == 0
    code, out, _ = run_cli(capsys, "repack", str(tmp_path / "p"), str(tmp_path / "t"), "--to", "tr3")
    assert code == 0 and "tr3" in out
    code, _, err = run_cli(capsys, "repack", str(tmp_path / "p"), str(tmp_path / "t2"))
    assert code == 2 and "--to tr3" in err


def test_validate_and_inspect_recognize_a_route_pack(capsys, source, tmp_path):
    out = tmp_path / "p"
    assert run_cli(capsys, "repack", str(source), str(out))[0] == 0
    code, stdout, _ = run_cli(capsys, "validate", "--checksums", str(out))
    assert code == 0 and "PASS" in stdout
    code, stdout, _ = run_cli(capsys, "inspect", str(out))
    assert code == 0 and "trellis-route-pack" in stdout
    layer_file = out / "layer-004-rank-1.safetensors"
    data = bytearray(layer_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    layer_file.write_bytes(bytes(data))
    code, stdout, _ = run_cli(capsys, "validate", "--checksums", str(out))
    assert code == 1 and "repack.hash-mismatch" in stdout


@pytest.mark.slow
def test_killed_repack_leaves_out_untouched_and_a_rerun_resumes(capsys, tmp_path):
    import dataclasses
    import os
    import signal
    import subprocess
    import sys
    import time

    spec = dataclasses.replace(synth.preset("tiny"), hidden=1024, intermediate=1024, experts=16,
                               layers=tuple(range(3, 11)), partition=(12, 4))
    src = synth.write_checkpoint(tmp_path / "src", spec)
    out, state = tmp_path / "out", tmp_path / "out.partial" / "state.json"
    proc = subprocess.Popen([sys.executable, "-m", "trellis_cli", "repack", str(src), str(out), "--jobs", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if state.is_file() and json.loads(state.read_text() or "{}").get("files"):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    if proc.returncode == 0:
        pytest.skip("the repack finished before it could be interrupted")
    assert not out.exists()
    code, stdout, _ = run_cli(capsys, "repack", str(src), str(out), "--json")
    doc = json.loads(stdout)
    assert code == 0 and doc["files_resumed"] >= 1 and doc["files_resumed"] + doc["files_written"] == 16
