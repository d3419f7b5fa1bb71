"""`trellis bench --tp N` on CPUs: argument checks through the CLI, and the gloo path (`--device cpu --smoke`):
each rank's slice forward, all-reduced, against the float64 forward of the whole, unsliced layer.

Checkpoints are micro TR3 synths (H 128, I 256, 4 experts) so that a rank process's work takes a fraction of
a second; what costs time is starting the rank processes (a torch import each), hence the slow marks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cuda_available
from helpers import run_cli, without_hint
from trellis_cli import synth

MICRO = dict(hidden=128, intermediate=256, experts=4, layers=(3,), partition=(3, 1), top_k=2)
CPU_LIMIT = 1e-5  # bench/tp_check.py: float32 reference per rank vs float64 whole layer
REPO = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


run = run_cli  # the one in-process CLI runner (tests/helpers.py)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in LAUNCH_VARS:  # a launcher's variables in the test's own environment would change the path
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """An in-process rank on one thread: the reference's float64 Hadamard of a transposed weight runs a strided
    batched matmul that two OpenMP threads on a busy two-core machine make ~15x slower, not faster."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("tp") / "tp2", synth.SynthSpec(tp=2, **MICRO))


@pytest.fixture(scope="module")
def tp1(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("tp") / "tp1", synth.SynthSpec(tp=1, **MICRO))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_matches_whole_layer(doc: dict, tp: int, reference: str = "whole layer") -> None:
    assert doc["tp"] == tp and doc["backend"] == "gloo" and doc["device"] == "cpu"
    assert doc["reference"] == reference and doc["passed"] is True
    reduced = [c for c in doc["checks"] if c["name"] == f"TP{tp} all-reduce vs float64"]
    assert [c["case"] for c in reduced] == ["M=1", "M=7", "M=64"]
    for check in doc["checks"]:
        # float32 against float64 is never exact on random inputs: a zero would mean nothing was computed
        assert 0 < check["value"] <= CPU_LIMIT and check["passed"], check


def test_tp1_on_cpu_matches_the_whole_layer_and_equals_its_one_rank(capsys, tp1):
    code, out, err = run(capsys, "bench", str(tp1), "--tp", "1", "--device", "cpu", "--smoke", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert_matches_whole_layer(doc, 1)
    slices = [c["value"] for c in doc["checks"] if c["name"] == "rank slice vs float64"]
    reduced = [c["value"] for c in doc["checks"] if c["name"] == "TP1 all-reduce vs float64"]
    assert slices == reduced  # one rank: its slice is the layer, and a group of one sums nothing


@pytest.mark.slow
@pytest.mark.parametrize("source", ["tp2", "tp1"], ids=["as-stored", "re-sliced-from-tp1"])
def test_tp2_on_cpu_matches_the_whole_layer(capsys, request, source):
    path = request.getfixturevalue(source)
    code, out, err = run(capsys, "bench", str(path), "--tp", "2", "--device", "cpu", "--smoke", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert_matches_whole_layer(doc, 2)
    assert f"source TP{source[-1]}" in doc["source"]


@pytest.mark.slow
def test_tp2_route_pack_is_checked_against_its_summed_slices(capsys, tp2, tmp_path):
    code, _, err = run(capsys, "repack", str(tp2), str(tmp_path / "rp"))
    assert code == 0, err
    code, out, err = run(capsys, "bench", str(tmp_path / "rp"), "--tp", "2", "--device", "cpu", "--smoke", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["source"].startswith(f"route-pack {tmp_path / 'rp'} layer ")  # the CLI's word for the source
    assert_matches_whole_layer(doc, 2, reference="sum of rank slices")


@pytest.mark.slow
def test_tp2_exl3v1_is_checked_against_the_layer_at_tp1(capsys, tmp_path):
    spec = synth.SynthSpec(tp=1, **{**MICRO, "intermediate": 512})  # mixed K needs whole 256-channel pairs per rank
    synth.write_checkpoint(tmp_path / "tr3", spec)
    code, _, err = run(capsys, "repack", str(tmp_path / "tr3"), str(tmp_path / "v1"), "--to", "exl3-v1")
    assert code == 0, err
    code, out, err = run(capsys, "bench", str(tmp_path / "v1"), "--tp", "2", "--device", "cpu", "--smoke", "--json")
    assert code == 0, err
    assert_matches_whole_layer(json.loads(out), 2)
    code, _, err = run(capsys, "bench", str(tmp_path / "v1"), "--tp", "3", "--device", "cpu", "--smoke")
    assert code == 2 and "slot extents split into TP" in err


@pytest.mark.slow
def test_a_failing_rank_is_one_line_naming_it(capsys, tp2, tmp_path):
    code, _, err = run(capsys, "repack", str(tp2), str(tmp_path / "rp"))
    assert code == 0, err
    shutil.copyfile(tmp_path / "rp" / "layer-003-rank-0.safetensors", tmp_path / "rp" / "layer-003-rank-1.safetensors")
    code, out, err = run(capsys, "bench", str(tmp_path / "rp"), "--tp", "2", "--device", "cpu", "--smoke")
    lines = without_hint(err).strip().splitlines()
    assert code == 1 and out == ""
    assert lines[-1].startswith("error: rank 1: layer-003-rank-1.safetensors: holds layer 3 rank 0"), err
    assert "Traceback" not in err and "SIGTERM" not in err  # the stopped peers are not reported


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "0"], "--tp 0: must be at least 1"),
    (["--tp", "3"], "does not split into 3 ranks"),
    (["--tp", "4"], "not a multiple of 128"),
    (["--tp", "1"], "merges source ranks"),  # tp2's rank slices were quantized separately
    (["--tp", "2", "--device", "cpu"], "--device cpu runs the check only"),
    (["--tp", "2", "--device", "tpu", "--smoke"], "--device 'tpu'"),
    (["--tp", "2", "--rank", "1"], "--rank does not apply with --tp"),
    (["--tp", "2", "--layer", "9"], "--layer 9: not a MoE layer"),
])
def test_tp_usage_errors_are_one_line_exit_2_before_any_rank(capsys, tp2, argv, needle):
    code, out, err = run(capsys, "bench", str(tp2), *argv)
    lines = without_hint(err).strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0]


def test_synthetic_tp_the_preset_cannot_slice_is_exit_2(capsys):
    code, _, err = run(capsys, "bench", "--synthetic", "glm52-tp4", "--tp", "3")
    assert code == 2 and "does not split into 3 ranks" in err and len(without_hint(err).strip().splitlines()) == 1


def test_route_pack_tp_is_fixed(capsys, tp2, tmp_path):
    code, _, err = run(capsys, "repack", str(tp2), str(tmp_path / "rp"))
    assert code == 0, err
    code, _, err = run(capsys, "bench", str(tmp_path / "rp"), "--tp", "1", "--device", "cpu", "--smoke")
    assert code == 2 and "was written for TP 2" in err and len(without_hint(err).strip().splitlines()) == 1


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("argv", [["SOURCE", "--tp", "2"], ["SOURCE", "--tp", "2", "--smoke"],
                                  ["--synthetic", "glm52-tp4", "--tp", "4", "--json"]])
def test_tp_without_enough_gpus_is_exit_4_in_one_line(capsys, tp2, argv):
    argv = [str(tp2) if a == "SOURCE" else a for a in argv]
    code, out, err = run(capsys, "bench", *argv)
    lines = without_hint(err).strip().splitlines()
    assert code == 4 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("error: --tp ") and "CUDA GPUs (one per rank), 0 visible" in lines[0]


# ---- a launcher's environment (torchrun sets these variables; the process joins instead of spawning) ---------

def launcher_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def test_launched_single_rank_joins_the_environment_group(capsys, monkeypatch, tp1):
    for name, value in launcher_env(0, 1, free_port()).items():
        monkeypatch.setenv(name, value)
    code, out, err = run(capsys, "bench", str(tp1), "--tp", "1", "--device", "cpu", "--smoke", "--json")
    assert code == 0, err
    assert_matches_whole_layer(json.loads(out), 1)


@pytest.mark.parametrize("env, needle", [
    ({"WORLD_SIZE": "2"}, "--tp 1 but the launcher's WORLD_SIZE is 2"),
    ({"MASTER_PORT": ""}, "MASTER_PORT is not"),
    ({"RANK": "x"}, "must be integers"),
])
def test_bad_launcher_environment_is_exit_2(capsys, monkeypatch, tp1, env, needle):
    for name, value in {**launcher_env(0, 1, free_port()), **env}.items():
        monkeypatch.setenv(name, value)
    code, _, err = run(capsys, "bench", str(tp1), "--tp", "1", "--device", "cpu", "--smoke")
    assert code == 2 and needle in err and len(without_hint(err).strip().splitlines()) == 1, err


@pytest.mark.slow
def test_two_launched_rank_processes_check_tp2_and_only_rank_0_reports(tp1):
    port = free_port()
    argv = [sys.executable, "-m", "trellis_cli", "bench", str(tp1), "--tp", "2", "--device", "cpu", "--smoke",
            "--json"]
    base = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(argv, env={**base, **launcher_env(r, 2, port)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [r[1] for r in results]
    assert_matches_whole_layer(json.loads(results[0][0]), 2)
    assert results[1][0] == ""


# ---- the GPU report, from rank rows as the ranks send them (the timing itself needs NCCL and GPUs) ----------

def rank_row(m: int, kernel: float, reduce: float, layer: float, graphs: bool = True) -> dict:
    timing = lambda us: {"median_us": us, "min_us": us - 1, "max_us": us + 1, "replays": 100}  # noqa: E731
    return {"m": m, "copies": 3, "experts": 40, "bytes": 1000, "kernel": timing(kernel),
            "all_reduce": timing(reduce), "layer": timing(layer), "graphs": graphs}


def test_tp_report_takes_the_slowest_rank_and_keeps_every_rank(capsys):
    from trellis_cli.bench.tp_timing import combine_ranks
    from trellis_cli.cli.bench_tp import print_tp_timing

    per_rank = [[rank_row(1, 10.0, 5.0, 16.0), rank_row(64, 30.0, 8.0, 40.0)],
                [rank_row(1, 12.0, 4.0, 17.0), rank_row(64, 28.0, 9.0, 41.0, graphs=False)]]
    rows = combine_ranks(per_rank, hidden=6144)
    first, second = rows
    assert first["kernel"] == {"min_us": 10.0, "max_us": 12.0, "per_rank_us": [10.0, 12.0]}
    assert first["all_reduce"]["median_us"] == 5.0 and first["layer"]["median_us"] == 17.0
    assert first["all_reduce_bytes"] == 1 * 6144 * 4 and first["graphs"] is True
    assert second["layer_over_max_kernel"] == pytest.approx(41.0 / 30.0) and second["graphs"] is False
    print_tp_timing({"source": "synthetic glm52-tp4 at TP2", "cold": True, "out_dtype": "float32", "backend": "nccl",
                   "rows": rows})
    out = capsys.readouterr().out
    assert "kernel max µs" in out and "41.0" in out and "eager" in out
