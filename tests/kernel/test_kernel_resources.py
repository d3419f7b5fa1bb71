"""Every launch plan fits the arch it is made for: the resource table per arch, the kernels' shared memory,
threads and registers (ptxas's numbers, recorded by the build), and the refusal where nothing fits."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import DATA, requires_nvcc
from helpers import run_cli
from trellis_cli.cli.exit_codes import exit_code
from trellis_cli.errors import GpuUnavailable, UsageError
from trellis_cli.kernel import arch_limits, resources
from trellis_cli.kernel.arch_limits import ARCH_TABLE, KB, device_limits, limits_for_arch, override_limits
from trellis_cli.kernel.plan import KernelDoesNotFit, make_plan, plan_kernels
from trellis_cli.kernel.resources import Usage, kernel_symbol, parse_ptxas, read_record

RECORDS = DATA / "kernel_resources"  # ptxas's numbers as the build recorded them, per arch (every codebook)
CODEBOOKS = ("mcg", "3inst", "mul1")
# (hidden, intermediate per rank, experts, top_k): glm52-tp4, and a shape whose I is no multiple of 256
# (128-row tiles then run on mma.sync even where wgmma exists).
GEOMETRIES = ((6144, 512, 256, 8), (4096, 384, 64, 6))


def usage_for(arch: str) -> dict:
    path = RECORDS / f"{arch}.json"
    return read_record(path) if path.is_file() else {}


def fits_by_hand(kernel, limits, usage: Usage | None) -> bool:
    """The test's own reading of the limits: one CTA of the kernel is resident on one SM of the arch."""
    registers = usage.registers if usage else kernel.register_budget
    smem = kernel.dynamic_smem + (usage.static_smem if usage else 0)
    return (smem <= limits.smem_per_block_optin and smem + limits.reserved_smem_per_block <= limits.smem_per_sm
            and registers <= limits.max_registers_per_thread
            and (registers + 7) // 8 * 8 * kernel.threads <= limits.registers_per_sm  # allocated per 8
            and kernel.threads <= limits.max_threads_per_sm)


def walk(arch: str, ms, fast: bool, codebook: str, geometry) -> tuple[set[int], list[int]]:
    """Every plan of `ms` for the arch: checks each kernel it launches fits; returns the tiles used and the
    M that were refused."""
    limits, usage = ARCH_TABLE[arch], usage_for(arch)
    hidden, inter, experts, top_k = geometry
    tiles, refused = set(), []
    for m in ms:
        try:
            plan = make_plan(m, top_k, hidden, inter, experts, wgmma=limits.wgmma, num_experts=experts,
                             limits=limits, codebook=codebook, fast=fast, usage=usage)
        except KernelDoesNotFit as err:
            assert arch in str(err) and "fc1_kernel" in str(err)
            refused.append(m)
            continue
        wgmma = limits.wgmma and hidden % 256 == 0 and inter % 256 == 0
        # The arch's own build: without wgmma, the compact FC1 kernels (resources.fc1_chunk_tiles).
        for kernel in plan_kernels(plan.m_tile, m * top_k, experts, wgmma, codebook, fast, not limits.wgmma):
            assert fits_by_hand(kernel, limits, usage.get(kernel.symbol)), (arch, m, plan, kernel)
        tiles.add(plan.m_tile)
    return tiles, refused


def small_tiles_fit(arch: str, fast: bool, codebook: str) -> bool:
    limits, usage = ARCH_TABLE[arch], usage_for(arch)
    kernels = resources.gemm_kernels(codebook, "mma16", fast, compact=not limits.wgmma)
    return all(fits_by_hand(k, limits, usage.get(k.symbol)) for k in kernels)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCH_TABLE))
def test_every_plan_fits_every_arch(arch: str):
    """Every M up to 8192, both kernel sets, every codebook: no arch refuses (the 99 KB archs run the all-K
    kernels, K 1..8, on their compact FC1)."""
    for fast in (True, False):
        for codebook in CODEBOOKS:
            for geometry in GEOMETRIES:
                tiles, refused = walk(arch, range(1, 8193), fast, codebook, geometry)
                # Refused only where even the smallest tiles cannot launch, and then at every M.
                assert small_tiles_fit(arch, fast, codebook), (arch, fast, codebook)
                assert not refused and 16 in tiles, (arch, fast, codebook, geometry)


def test_plans_on_the_archs_users_own():
    """Which tiles each arch's plans take (a sample of M): Blackwell workstation cards and Ada/Ampere run 16-,
    32- and 128-row tiles on K3/K4 layers (the compact 128-row FC1, 88 KB) and 16- and 32-row tiles on the
    all-K kernels, FC1 in chunks of 32 columns and FC2 of 64), Hopper wgmma, B200 and A100 128-row mma.sync."""
    ms = (1, 8, 64, 200, 512, 1024, 3072, 8192)
    assert walk("sm_120", ms, True, "mcg", GEOMETRIES[0]) == ({16, 32, 128}, [])
    assert walk("sm_121", ms, True, "mcg", GEOMETRIES[0]) == ({16, 32, 128}, [])
    assert walk("sm_90", ms, True, "mcg", GEOMETRIES[0]) == ({16, 128}, [])
    assert walk("sm_100", ms, True, "mcg", GEOMETRIES[0]) == ({16, 32, 128}, [])
    assert walk("sm_80", ms, False, "mcg", GEOMETRIES[0]) == ({16, 32, 128}, [])
    assert walk("sm_120", ms, False, "mcg", GEOMETRIES[0]) == ({16, 32, 128}, [])
    # A library with wgmma holds the full FC1 kernels (168 KB at 128 rows): under sm_120's limits 32 rows.
    plan = make_plan(3072, 8, 6144, 512, 256, wgmma=True, num_experts=256, limits=ARCH_TABLE["sm_120"])
    assert (plan.m_tile, plan.family) == (32, "mma32")  # wgmma asked for, but the arch has none


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_120", "sm_121"])
def test_every_k_plans_on_the_archs_without_wgmma(arch: str):
    """K 2..6 (the all-K kernels) and K3/K4 on every codebook plan every M up to 8192 within the arch's limits."""
    for fast in (True, False):
        for codebook in CODEBOOKS:
            tiles, refused = walk(arch, (1, 3, 8, 16, 64, 200, 512, 1024, 2048, 3072, 4096, 8192), fast, codebook,
                                  GEOMETRIES[0])
            assert not refused and {16, 32} <= tiles, (arch, fast, codebook)


@pytest.mark.parametrize("arch", sorted(ARCH_TABLE))
def test_every_k_from_2_to_6_plans_on_every_arch(arch: str):
    """A layer of K3 and each K from 2 to 6 takes the kernel set that serves it (K3/K4 or all K) and plans every
    M up to 8192 on every arch, each kernel of the plan within the arch's limits, 128-row tiles at large M."""
    from trellis_cli.kernel.build import kernels_for

    ms = (1, 8, 64, 512, 1024, 3072, 8192)
    for k in range(2, 7):
        fast = kernels_for((3, k)) == "k3k4"
        assert fast == (k in (3, 4))
        tiles, refused = walk(arch, ms, fast, "mcg", GEOMETRIES[0])
        assert not refused and 16 in tiles and 128 in tiles, (arch, k, tiles)


def test_forced_tile_that_does_not_fit_is_refused_naming_arch_limit_and_kernel():
    with pytest.raises(KernelDoesNotFit) as err:  # a library with wgmma: the full 128-row FC1
        make_plan(3072, 8, 6144, 512, 256, m_tile=128, wgmma=True, limits=ARCH_TABLE["sm_120"])
    message = str(err.value)
    assert "\n" not in message
    assert "sm_120" in message and "shared memory per block" in message and "fc1_kernel<mcg, 128 rows" in message
    assert "172032 bytes" in message and "101376 bytes" in message
    assert exit_code(err.value) == 4  # the CLI's table: no usable GPU / kernel


def test_table_rows():
    """The numbers docs/kernel.md cites, row by row (KB = 1024 bytes)."""
    expect = {  # arch: (KB per SM, KB per block opt-in, threads per SM, blocks per SM, wgmma)
        "sm_80": (164, 163, 2048, 32, False), "sm_86": (100, 99, 1536, 16, False),
        "sm_89": (100, 99, 1536, 24, False), "sm_90": (228, 227, 2048, 32, True),
        "sm_100": (228, 227, 2048, 32, False), "sm_120": (100, 99, 1536, 24, False),
        "sm_121": (100, 99, 1536, 24, False),
    }
    assert set(ARCH_TABLE) == set(expect)
    for arch, (per_sm, per_block, threads, blocks, wgmma) in expect.items():
        row = ARCH_TABLE[arch]
        assert (row.smem_per_sm, row.smem_per_block_optin) == (per_sm * KB, per_block * KB)
        assert (row.max_threads_per_sm, row.max_blocks_per_sm, row.wgmma) == (threads, blocks, wgmma)
        assert (row.registers_per_sm, row.max_registers_per_thread, row.reserved_smem_per_block) == (65536, 255, 1024)
    assert limits_for_arch("120") is ARCH_TABLE["sm_120"]
    with pytest.raises(GpuUnavailable, match="too old"):
        limits_for_arch("sm_75")


def test_test_only_override(monkeypatch):
    monkeypatch.setenv(arch_limits.PLAN_LIMITS_ENV, "sm_120")
    forced = override_limits()
    assert forced.arch == "sm_120" and forced.source == "override"
    assert device_limits() == forced  # on any device, or none
    monkeypatch.setenv(arch_limits.PLAN_LIMITS_ENV, "sm_70")
    with pytest.raises(UsageError, match="TRELLIS_PLAN_LIMITS"):
        override_limits()


def test_no_device_without_override(monkeypatch):
    import torch

    monkeypatch.delenv(arch_limits.PLAN_LIMITS_ENV, raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(GpuUnavailable, match="no CUDA device"):
        device_limits()


# ---------------------------------------------------------------------------------------------------------
# ptxas's numbers


PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7trellis10fc1_kernelILi1ELi2ELb1EEEv14TrellisMoeArgsNS_9Fc1PiecesE' for 'sm_120'
ptxas info    : Function properties for _ZN7trellis10fc1_kernelILi1ELi2ELb1EEEv14TrellisMoeArgsNS_9Fc1PiecesE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 63 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN7trellis17route_pack_kernelEv14TrellisMoeArgs' for 'sm_120'
ptxas info    : Used 24 registers, used 1 barriers, 16 bytes smem
"""


def test_parse_ptxas_and_symbols():
    parsed = parse_ptxas(PTXAS)
    assert parsed == {
        "_ZN7trellis10fc1_kernelILi1ELi2ELb1EEEv14TrellisMoeArgsNS_9Fc1PiecesE": {"registers": 63, "static_smem": 0},
        "_ZN7trellis17route_pack_kernelEv14TrellisMoeArgs": {"registers": 24, "static_smem": 16},
    }
    assert kernel_symbol("_ZN7trellis10fc1_kernelILi1ELi2ELb1EEEv14TrellisMoeArgsNS_9Fc1PiecesE") == ("fc1_kernel", (1, 2, 1))
    assert kernel_symbol("_ZN7trellis16fc2_wgmma_kernelILi0ELb1ELi64EEEv14TrellisMoeArgs") == ("fc2_wgmma_kernel", (0, 1, 64))
    assert kernel_symbol("_ZN7trellis17route_pack_kernelEv14TrellisMoeArgs") == ("route_pack_kernel", ())
    assert kernel_symbol("_Z3foov") is None


@pytest.mark.parametrize("record", sorted(RECORDS.glob("*.json")), ids=lambda p: p.stem)
def test_recorded_usage_within_launch_bounds(record: Path):
    """Every GEMM kernel the build recorded stays within its launch-bounds budget, the number a plan falls
    back to without a record; and the record holds every kernel a plan names."""
    usage = read_record(record)
    arch = json.loads(record.read_text())["arch"]
    assert record.stem == arch
    seen = 0
    for codebook in CODEBOOKS:
        families = ("mma16", "mma32", "mma128", "wgmma") if ARCH_TABLE[arch].wgmma else ("mma16", "mma32", "mma128")
        for family in families:
            for fast in (True, False):
                for narrow in ((False, True) if family == "wgmma" and fast else (False,)):
                    for kernel in resources.gemm_kernels(codebook, family, fast, narrow):
                        found = usage[kernel.symbol]
                        assert 0 < found.registers <= kernel.register_budget, (kernel, found)
                        seen += 1
    assert seen >= 36


@requires_nvcc
@pytest.mark.slow
def test_twins_match_the_kernels_constants(tmp_path: Path):
    """resources.py's shared memory and threads against the kernels' own constexpr functions, compiled."""
    from trellis_cli.kernel.build import kernel_source_dir
    from trellis_cli.kernel.nvcc import find_nvcc

    program = tmp_path / "twins.cu"
    program.write_text("""#include <stdio.h>
#include "expert_gemm.cuh"
#include "expert_wgmma.cuh"
int main() {
  using namespace trellis;
  for (int r : {1, 2, 8})
    for (int f : {0, 1}) printf("gemm %d %d %d %d\\n", r, f, fc1_smem_bytes(r, f), fc2_smem_bytes(r, f));
  for (int rows : {64, 128})
    for (int f : {0, 1}) printf("wgmma %d %d %d\\n", rows, f, wg_smem_bytes(f, rows));
  printf("threads %d %d %d %d\\n", kFc1Threads, kFc2Threads, kWgThreads, kPackThreads);
  return 0;
}
""")
    # Host code only (the constexpr functions): compiled as the wgmma build and as every other arch's build
    # (no TRELLIS_WGMMA: the compact FC1), whose wgmma lines are the same constants.
    for compact, flags in ((False, ["-gencode=arch=compute_90a,code=sm_90a", "-DTRELLIS_WGMMA"]),
                           (True, ["-gencode=arch=compute_90,code=sm_90"])):
        binary = tmp_path / f"twins-{int(compact)}"
        subprocess.run([find_nvcc(), "-std=c++17", *flags, "-I", str(kernel_source_dir()), "-o", str(binary),
                        str(program)], check=True, timeout=300)
        lines = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines()
        for line in lines:
            kind, *values = line.split()
            numbers = list(map(int, values))
            if kind == "gemm":
                r, fast, fc1, fc2 = numbers
                assert (resources.fc1_smem_bytes(r, bool(fast), compact),
                        resources.fc2_smem_bytes(r, bool(fast), compact)) == (fc1, fc2), (compact, line)
            elif kind == "wgmma":
                rows, fast, smem = numbers
                assert resources.wg_smem_bytes(bool(fast), rows) == smem
            else:
                assert numbers == [resources.FC1_THREADS, resources.FC2_THREADS, resources.WGMMA_THREADS,
                                   resources.PACK_THREADS]
        assert len(lines) == 11


# ---------------------------------------------------------------------------------------------------------
# Through the CLI: `trellis bench --plan`, no GPU, no build


def test_cli_plan_for_blackwell_workstation_cards(capsys):
    code, out, err = run_cli(capsys, "bench", "--plan", "--arch", "sm_120", "--synthetic", "glm52-tp4",
                             "--m", "1,64,3072", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["limits"]["arch"] == "sm_120" and doc["limits"]["smem_per_block_optin"] == 99 * KB
    assert [(p["m"], p["m_tile"], p["family"], p["direct"]) for p in doc["plans"]] == [
        (1, 16, "mma16", True), (64, 16, "mma16", False), (3072, 128, "mma128", False)]


def test_cli_plans_every_k_on_99_kb(capsys, tmp_path: Path):
    """A K3/K5 checkpoint (the all-K kernels) plans on sm_120 at every M; sm_80 takes 128-row tiles at large M."""
    ckpt = tmp_path / "k35"
    code, _, err = run_cli(capsys, "synth", str(ckpt), "--k-values", "3,5")
    assert code == 0, err
    code, out, err = run_cli(capsys, "bench", "--plan", "--arch", "sm_120", str(ckpt), "--m", "1,64,8192")
    assert code == 0 and "error" not in err, err
    assert "M=1: direct, 16-row tiles on mma16" in out and "M=8192: packed, 128-row tiles on mma128" in out, out
    code, out, err = run_cli(capsys, "bench", "--plan", "--arch", "sm_80", str(ckpt), "--m", "1,64,8192")
    assert code == 0 and "M=8192: packed, 128-row tiles on mma128" in out, err


def test_cli_plan_arguments(capsys, monkeypatch):
    import torch

    code, _, err = run_cli(capsys, "bench", "--plan", "--arch", "sm_75", "--synthetic", "glm52-tp4")
    assert code == 2 and "sm_75 is too old" in err
    code, _, err = run_cli(capsys, "bench", "--plan", "--compile-only", "--synthetic", "glm52-tp4")
    assert code == 2
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "bench", "--plan", "--synthetic", "glm52-tp4")
        assert code == 2 and "--arch" in err


# ---------------------------------------------------------------------------------------------------------
# Where the kernel cannot run: one line, exit 4


def test_launch_failure_is_one_line_naming_arch_reason_and_kernel():
    from trellis_cli.kernel.launch import launch_failure

    plan = make_plan(64, 8, 6144, 512, 256, num_experts=256, limits=ARCH_TABLE["sm_120"])
    # What trellis_moe.cu reports for a refused launch, and the CUDA error numbers of a driver too old for
    # the library's PTX (222) and of a library without code for the GPU (209).
    library_says = ("CUDA refused the FC1 launch (512 threads, 99840 bytes of dynamic shared memory): "
                    "too many resources requested for launch")
    for rc, reason in ((701, "the device refused the launch"), (222, "driver is too old"),
                       (209, "no code for this GPU's arch")):
        line = launch_failure(rc, library_says + "\n", "sm_120", plan, ARCH_TABLE["sm_120"])
        assert "\n" not in line and reason in line
        assert line.startswith("fused kernel on sm_120 (library built for sm_120): ")
        assert "FC1 launch (512 threads, 99840 bytes" in line and "16-row tiles on mma16" in line
        assert "99 KB shared memory per block" in line


class _OldGpu:  # what torch reports for a Turing card: the properties device_limits reads
    major, minor, name = 7, 5, "Tesla T4"


def test_gpu_older_than_sm80_is_one_line_exit_4(monkeypatch, capsys):
    """No GPU here: torch's device queries answer as a T4 would (the only stand-in; the CLI and the plan are
    the real ones)."""
    import torch

    monkeypatch.delenv(arch_limits.PLAN_LIMITS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _OldGpu())
    with pytest.raises(GpuUnavailable, match=r"^GPU arch sm_75 is too old: the kernel needs sm_80 or newer$"):
        device_limits()
    code, out, err = run_cli(capsys, "bench", "--plan", "--synthetic", "glm52-tp4", "--m", "1")
    assert code == 4 and out == "" and "Traceback" not in err
    assert [l for l in err.splitlines() if l.startswith("error:")] == [
        "error: GPU arch sm_75 is too old: the kernel needs sm_80 or newer"]


@requires_nvcc
@pytest.mark.slow
def test_the_build_records_ptxas_numbers(monkeypatch, tmp_path: Path):
    """A real build (mcg's K3/K4 kernels for sm_120) leaves ptxas's numbers beside every object and its library,
    and a plan read from them fits."""
    from trellis_cli.kernel import build
    from trellis_cli.kernel.resources import record_path

    monkeypatch.setenv("TRELLIS_KERNEL_CACHE", str(tmp_path))
    library = build.build_library("sm_120", "mcg", kernels="k3k4")
    objects = sorted((tmp_path / "objects").glob("*.o"))
    assert len(objects) == 4 and all(record_path(o).is_file() for o in objects)
    usage = read_record(record_path(library.path))
    for family in ("mma16", "mma32", "mma128"):
        for kernel in resources.gemm_kernels("mcg", family, True):
            assert 0 < usage[kernel.symbol].registers <= kernel.register_budget
    plan = make_plan(3072, 8, 6144, 512, 256, num_experts=256, limits=ARCH_TABLE["sm_120"], usage=usage)
    assert plan.family == "mma128"  # the compact 128-row FC1 (88 KB) within 99 KB
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.log"))
