"""The nvcc build: the bundled sources compile for sm_90 (one cached build, with wgmma), failures are exit-4 errors."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from conftest import requires_nvcc
from trellis_cli.errors import GpuUnavailable
from trellis_cli.kernel import build


@requires_nvcc
@pytest.mark.slow
def test_kernel_sources_compile_for_sm90_and_are_cached():
    first = build.build_library("sm_90")
    assert first.path.is_file() and first.arch == "sm_90"
    assert first.path.parent == build.cache_dir()
    again = build.build_library("sm_90")
    assert again.cached and again.path == first.path and again.build_hash == first.build_hash
    # Loading needs no GPU: the Hopper build says its large tiles run on wgmma.
    from trellis_cli.kernel.abi import load_library

    assert load_library(first.path, first.build_hash, first.arch).wgmma
    # The timeline hooks (kernels/timeline.cuh) compile to nothing in the production build.
    assert not hasattr(ctypes.CDLL(str(first.path)), "trellis_timeline_read")


@requires_nvcc
@pytest.mark.slow
def test_timeline_diagnostic_build_compiles_and_exports_its_reader(tmp_path: Path):
    # scripts/timeline.py loads a library built this way; one codebook keeps the build short.
    target = tmp_path / "timeline.so"
    source = build.kernel_source_dir() / build.ENTRY_SOURCE
    command = [build.find_nvcc(), *build.NVCC_FLAGS, *build.arch_flags("sm_90"), "-DTRELLIS_ONLY_MCG",
               "-DTRELLIS_TIMELINE", "-o", str(target), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=build.BUILD_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert hasattr(ctypes.CDLL(str(target)), "trellis_timeline_read")


@requires_nvcc
def test_compile_error_carries_the_compiler_message(tmp_path: Path):
    broken = tmp_path / "broken.cu"
    broken.write_text("__global__ void k() { this_is_not_cuda; }\n")
    target = tmp_path / "out.so"
    with pytest.raises(GpuUnavailable) as info:
        build._compile(build.find_nvcc(), "sm_90", broken, target)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("kernel build failed for sm_90")
    assert any("this_is_not_cuda" in line for line in lines[1:])
    assert not target.exists() and not list(tmp_path.glob("*.tmp"))


def test_missing_nvcc_is_a_gpu_error(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TRELLIS_NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "no-cuda"))
    # find_nvcc's last resort is the default toolkit location: hidden here, so the test also runs where a
    # toolkit is installed there.
    executable = os.access
    monkeypatch.setattr(build.os, "access",
                        lambda path, mode: not str(path).startswith("/usr/local/cuda/") and executable(path, mode))
    with pytest.raises(GpuUnavailable, match="nvcc not found"):
        build.find_nvcc()


def test_cache_dir_follows_xdg(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / "trellis" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "trellis" / "kernels"
