"""The CLI loads numpy with one BLAS thread (its pool would spin on the cores the scan workers read with) and leaves
OPENBLAS_NUM_THREADS as the caller set it, for any library loaded later."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import os, sys
import trellis_cli.cli.app as app
app._load_numpy_with_one_blas_thread()
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
