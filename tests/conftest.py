"""Shared test fixtures: pinned environment, seeded RNGs, golden data, recorded terminal, GPU skip markers."""

from __future__ import annotations

import io
import os
import random
import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# The CLI's consoles take their width when first imported, which happens at collection, before the pinned
# environment below applies: set here, it is the same in every process (a pytest-xdist worker's stdout can
# be a terminal, where rich would otherwise fall back to 80 columns).
os.environ["COLUMNS"] = "160"


@pytest.fixture(autouse=True)
def _pinned_environment(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    random.seed(0)
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover
        pass


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (the CLI draws progress only there), recorded."""
    from rich.console import Console

    from trellis_cli.cli import output

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=200, color_system=None, markup=False,
                      emoji=False, highlight=False)
    monkeypatch.setattr(output, "stderr", console)
    return buffer


@pytest.fixture(scope="session")
def golden():
    """Open a golden file from tests/data by name: golden("decode_golden") -> dict of tensors."""
    from safetensors.torch import load_file

    cache: dict[str, dict] = {}

    def load(name: str) -> dict:
        if name not in cache:
            cache[name] = load_file(str(DATA / f"{name}.safetensors"))
        return cache[name]

    return load


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def nvcc_available() -> bool:
    return shutil.which("nvcc") is not None or Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc").exists()


requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
requires_nvcc = pytest.mark.skipif(not nvcc_available(), reason="needs nvcc (CUDA toolkit)")


@pytest.fixture(scope="module", params=["pair-per-expert", "uniform-shared"])
def exl3(request, tmp_path_factory) -> Path:
    """A small exl3-v1 checkpoint, once per spec of helpers.exl3v1_specs."""
    from helpers import exl3v1_specs
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    return write_exl3v1_checkpoint(tmp_path_factory.mktemp(request.param) / "exl3", exl3v1_specs()[request.param])


@pytest.fixture(scope="session")
def glm52_tp4_sparse(tmp_path_factory) -> Path:
    """`synth --preset glm52-tp4 --sparse`, built once per session: real headers over holes, ~300 GB apparent,
    a few hundred MB on disk (the production shape of the fit tests)."""
    import dataclasses

    from trellis_cli.synth import preset, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("glm52") / "glm",
                            dataclasses.replace(preset("glm52-tp4"), sparse=True))


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory, request) -> Path:
    """The one kernel-build cache of a test run: $TRELLIS_KERNEL_CACHE when the caller set one (CI's
    --compile-only steps fill it first), else one folder shared by every pytest-xdist worker of this run, so a
    build made by one is reused by the others. Builds write each object under a temporary name and rename it
    (trellis_cli/kernel/build.py), so workers building at once never see half a file; `kernel_build_lock`
    makes the second wait for the first instead of building the same units again."""
    given = os.environ.get("TRELLIS_KERNEL_CACHE")
    if given:
        return Path(given)
    worker = getattr(request.config, "workerinput", None)  # set on pytest-xdist workers only
    if worker is None:
        return tmp_path_factory.mktemp("kcache")
    shared = tmp_path_factory.getbasetemp().parent / "kcache"  # the run's root, above each worker's folder
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture
def kernel_build_lock(kernel_cache):
    """Hold while building into `kernel_cache`: one worker builds, the others then find the build cached."""
    from filelock import FileLock

    with FileLock(str(kernel_cache) + ".lock"):
        yield kernel_cache

# The developer unit loop, `python -m pytest -q -n 2 -m unit` (README, docs/performance.md "Test suite time"):
# every test that writes no files (no temporary directory, so no synthetic checkpoint, repack or kernel build)
# and is not marked slow. The full suite, what CI runs, stays the proof.
_WRITES_FILES = frozenset({"tmp_path", "tmp_path_factory", "tmpdir", "tmpdir_factory"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and not _WRITES_FILES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.unit)
