"""`trellis bench` at the CLI boundary on a machine without a GPU: exit 4 in one line; --compile-only works."""

from __future__ import annotations

import json

import pytest

from conftest import cuda_available, requires_nvcc
from helpers import run_cli, without_hint


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("argv", [["bench", "--synthetic", "glm52-tp4"],
                                  ["bench", "--synthetic", "glm52-tp4", "--smoke"]])
def test_bench_without_gpu_exits_4_with_one_line(argv, capsys):
    code, out, err = run_cli(capsys, *argv)
    assert code == 4 and out == ""
    lines = without_hint(err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "GPU" in lines[0]


@pytest.mark.parametrize("argv", [["bench", "--m", "1,x"], ["bench", "--m", "0"],
                                  ["bench", "--arch", "sm_90", "--synthetic", "glm52-tp4"]])
def test_bad_bench_arguments_are_usage_errors(argv, capsys):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("error:")


@requires_nvcc
@pytest.mark.slow
def test_compile_only_builds_without_a_gpu(capsys, monkeypatch, kernel_build_lock):
    # Never the user's cache: the run's shared one (conftest.py: CI's, or one for all workers of this run).
    monkeypatch.setenv("TRELLIS_KERNEL_CACHE", str(kernel_build_lock))
    code, out, _ = run_cli(capsys, "bench", "--compile-only", "--arch", "sm_90", "--codebook", "mcg", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["arch"] == "sm_90" and len(doc["libraries"][0]["build_hash"]) == 16
