"""A command, as it is invoked, loads numpy with one BLAS thread (its pool would spin on the cores the scan workers
read with) and leaves OPENBLAS_NUM_THREADS as the caller set it, for any library loaded later; help loads no numpy
at all (tests/cli/test_startup_imports.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import os, sys
from trellis_cli.cli.options import load_numpy_with_one_blas_thread
load_numpy_with_one_blas_thread()
import numpy
print(len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS"))
"""


def _probe(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    return done.stdout.split()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to count the process's threads")
def test_numpy_is_loaded_with_one_blas_thread_and_the_variable_is_left_alone():
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    assert _probe(env) == ["1", "None"]  # the main thread alone, the variable unset again
    assert _probe({**env, "OPENBLAS_NUM_THREADS": "2"})[1] == "2"  # the caller's own setting kept


def test_a_command_loads_numpy_so_once_its_arguments_are_parsed_and_help_does_not(capsys, monkeypatch):
    from helpers import run_cli
    from trellis_cli.cli import app

    calls: list[bool] = []
    monkeypatch.setattr(app, "load_numpy_with_one_blas_thread", lambda: calls.append(True))
    assert run_cli(capsys, "validate", "--help")[0] == 0 and calls == []
    assert run_cli(capsys, "validate")[0] == 0 and calls == [True]  # (the bundled sample)
