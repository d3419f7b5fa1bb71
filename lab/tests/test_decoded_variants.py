"""lab/perf/decoded_variants.py: the decoded tiles patch a copy of the current kernels/ (every edit found once),
switched on only in builds without wgmma, and the patched kernels' shared memory fits sm_120's 99 KB."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from lab.perf.decoded_variants import parse_flags, write_sources
from trellis_cli.kernel import build


def test_sources_patch_a_copy_of_kernels(tmp_path: Path):
    on = write_sources(tmp_path / "on", fc1=True, fc2=False, interleaved=True)
    tile = (on / "gemm_tile.cuh").read_text()
    # the wgmma build keeps the compact kernels' dispatch whatever the variant says
    assert "#ifdef TRELLIS_WGMMA\nconstexpr bool kDecodedFc1 = false, kDecodedFc2 = false;\n#else\n" \
           "constexpr bool kDecodedFc1 = true, kDecodedFc2 = false;" in tile
    assert "fc1_decoded_body" in (on / "fc1.cuh").read_text() and "fc2_decoded_body" in (on / "fc2.cuh").read_text()
    assert "kDecodeInterleaved = true;" in (on / "decoded_mma.cuh").read_text()
    off = write_sources(tmp_path / "off", fc1=False, fc2=False, interleaved=False)
    assert "kDecodeInterleaved = false;" in (off / "decoded_mma.cuh").read_text()
    # the product's sources are untouched, and hold none of it
    assert not (build.kernel_source_dir() / "decoded_mma.cuh").exists()
    assert "kDecoded" not in (build.kernel_source_dir() / "gemm_tile.cuh").read_text()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
def test_decoded_kernels_fit_99_kb(tmp_path: Path):
    sources = write_sources(tmp_path / "kernels", fc1=True, fc2=True, interleaved=True)
    assert_compiles(sources, tmp_path / "fits",
                    "static_assert(fc1_smem_bytes(8, true) == 86016 && fc1_smem_bytes(8, false) == 98304, \"FC1\");\n"
                    "static_assert(fc2_smem_bytes(8, true) == 81920 && fc2_smem_bytes(8, false) == 94208, \"FC2\");\n"
                    "static_assert(fc1_smem_bytes(8, false) <= 99 * 1024 && fc2_smem_bytes(8, false) <= 99 * 1024, "
                    "\"99 KB\");\n")


def assert_compiles(sources: Path, stem: Path, asserts: str) -> None:
    """nvcc (sm_120) compiles `asserts` (static_asserts over the kernels' constexpr sizes) against `sources`."""
    check = stem.with_suffix(".cu")
    check.write_text('#include "expert_gemm.cuh"\nusing namespace trellis;\n' + asserts)
    done = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_120", "-I", str(sources), "-c", "-o",
                           str(stem.with_suffix(".o")), str(check)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_warp_specialized_fc1_patch(tmp_path: Path):
    ws = write_sources(tmp_path / "ws", fc1=True, fc2=False, interleaved=False, decoders=4)
    tile = (ws / "gemm_tile.cuh").read_text()
    # decoder warps only in builds without wgmma, and only the 128-row FC1 launches them (fc1_threads)
    assert "#ifdef TRELLIS_WGMMA\nconstexpr int kWsDecoders = 0;\n#else\nconstexpr int kWsDecoders = 4;" in tile
    assert "fc1_threads(R), fc1_smem_bytes(R, FAST)" in (ws / "gemm_unit.cu").read_text()
    fc1 = (ws / "fc1.cuh").read_text()
    assert "fc1_ws_body<CB, decltype(k)::value, FAST>" in fc1 and "__launch_bounds__(fc1_threads(R)" in fc1
    assert "kWsDecoders = 0;\n#endif" in (write_sources(tmp_path / "no", True, True, True) / "gemm_tile.cuh").read_text()


@pytest.mark.parametrize("flags", ["1,0", "1,0,0,3", "0,1,0,4", "1,0,2", "1,0,0,x"])
def test_bad_flags_are_refused(flags: str):
    with pytest.raises(SystemExit, match="expected FC1,FC2,INTERLEAVED|DECODERS needs"):
        parse_flags(flags)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
def test_warp_specialized_fc1_launch_shape(tmp_path: Path):
    sources = write_sources(tmp_path / "kernels", fc1=True, fc2=False, interleaved=False, decoders=4)
    assert_compiles(sources, tmp_path / "shape",
                    "static_assert(fc1_threads(8) == 640 && fc1_threads(1) == 512 && fc1_threads(2) == 512, "
                    "\"threads\");\n"
                    "static_assert(fc1_smem_bytes(8, true) == 86016 && fc1_smem_bytes(8, false) <= 99 * 1024, "
                    "\"99 KB\");\n")
