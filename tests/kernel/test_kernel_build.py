"""The nvcc build: units compiled in parallel and cached one by one, every kernel the library had before,
progress on stderr, a stalled compiler caught, failures as exit-4 errors. Every build writes into a
temporary cache ($TRELLIS_KERNEL_CACHE), never the user's."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DATA, requires_gpu, requires_nvcc
from helpers import run_cli
from trellis_cli.errors import GpuUnavailable, UsageError
from trellis_cli.kernel import build
from trellis_cli.kernel.jobs import Job, run_jobs

# A kernel's host-side function, as `nm -C` prints it (O3's "[clone .cold]" parts are left out).
KERNEL_SYMBOL = re.compile(r"^(?:void )?(trellis::\w+_kernel(?:<[^()]*>)?\([^()]*\))$")
FAKE_NVCC = Path(__file__).resolve().parents[1] / "fake_nvcc.py"
# The functions of kernels/abi.h: all that the production library exports.
PRODUCTION_EXPORTS = {"trellis_abi_version", "trellis_has_wgmma", "trellis_args_size", "trellis_moe_forward",
                      "trellis_last_error"}


def run(argv, capsys) -> tuple[int, str, str]:
    return run_cli(capsys, *argv)


@pytest.fixture
def cache(monkeypatch, tmp_path: Path) -> Path:
    folder = tmp_path / "kcache"
    monkeypatch.setenv("TRELLIS_KERNEL_CACHE", str(folder))
    return folder


def kernel_symbols(path: Path) -> set[str]:
    """The __global__ kernels a built object or library holds (their host-side stubs)."""
    listing = subprocess.run(["nm", "-C", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    found = set()
    for line in listing.stdout.splitlines():
        match = KERNEL_SYMBOL.match(line.split(" ", 2)[-1])
        if match:
            found.add(match.group(1))
    return found


def exported_functions(path: Path) -> set[str]:
    """The C functions a built library exports (its dynamic symbol table)."""
    listing = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    return {parts[2] for parts in (line.split() for line in listing.stdout.splitlines())
            if len(parts) == 3 and parts[1] == "T"}


def reference_symbols(arch: str, codebook: int | None = None, kernels: str = "all") -> set[str]:
    """The kernels of the single-unit library before the split (tests/data/PROVENANCE.md), optionally
    only those a library of one codebook (and kernel set) holds: its GEMM kernels and the shared ones. A
    GEMM kernel's FAST argument (the K3/K4 kernels) is the third of fc*_kernel<CB, R, FAST>, the second of
    fc*_wgmma_kernel<CB, FAST, ROWS>."""
    names = set((DATA / f"kernel_symbols_{arch}.txt").read_text().splitlines())
    if codebook is None:
        return names
    gemm = re.compile(r"^trellis::fc[12]_(wgmma_)?kernel<(\d), (\w+), (\w+)>")

    def holds(name: str) -> bool:
        match = gemm.match(name)
        if not match:
            return True
        fast = match.group(3) if match.group(1) else match.group(4)
        return match.group(2) == str(codebook) and (kernels == "all" or fast == "true")

    return {n for n in names if holds(n)}


# ---------------------------------------------------------------------------------------------------------
# Plan and hashes: no compiler needed.


def test_units_per_codebook_family_and_k_set():
    hopper = build.library_units("sm_90", "mcg")
    assert [u.name for u in hopper] == ["host"] + [f"mcg-{f}-{k}" for f in build.TILE_FAMILIES for k in build.K_SETS]
    ampere = [u.name for u in build.library_units("sm_80", "3inst")]
    assert len(ampere) == 7 and not any("wgmma" in n for n in ampere)  # sm_80 has no wgmma kernels
    assert build.library_units("sm_90", "mul1")[0] == hopper[0]  # one host unit serves every codebook
    assert "-DTRELLIS_UNIT_CODEBOOK=2" in build.library_units("sm_90", "mul1")[1].defines


def test_a_k3k4_library_holds_only_the_k3k4_units_and_is_named_apart():
    fast = build.library_units("sm_90", "mcg", kernels="k3k4")
    assert [u.name for u in fast] == ["host"] + [f"mcg-{f}-k3k4" for f in build.TILE_FAMILIES]
    assert set(fast) < set(build.library_units("sm_90", "mcg"))  # the same objects: one cache serves both
    link = build.build_commands("sm_90", "mcg", kernels="k3k4")[-1]
    assert link[-len(fast):] == [f"{u.name}.o" for u in fast] and "trellis_moe_k3k4-sm_90-mcg.so" in link
    assert build.kernels_for([3, 4]) == build.kernels_for([4]) == "k3k4"
    assert build.kernels_for([3, 2]) == build.kernels_for([8]) == "all"


def test_the_product_sources_carry_no_lab_hooks():
    # The lab adds its hooks to a copy of kernels/ (lab/kernel/sources.py) through build.BuildExtension; the
    # sources the wheel ships know nothing of it.
    hook = re.compile(r"TRELLIS_LAB|TRELLIS_TIMELINE|lab_flag|timeline|single_tu|#\s*include\s+[<\"](?:lab|timeline)\b",
                      re.I)
    files = sorted(p for p in build.kernel_source_dir().iterdir() if p.suffix in build.SOURCE_SUFFIXES)
    assert len(files) > 20
    assert [(p.name, m.group(0)) for p in files for m in hook.finditer(p.read_text())] == []
    assert not re.search(r"\blab\b|timeline|VARIANT", Path(build.__file__).read_text(), re.I)


def test_a_build_extension_compiles_its_own_sources_under_its_own_names(tmp_path: Path):
    (tmp_path / "trellis_moe.cu").write_text("// host\n")
    (tmp_path / "whole.cu").write_text('#include "trellis_moe.cu"\n')
    product = build.library_units("sm_90", "mcg", kernels="k3k4")
    extra = build.BuildExtension("probe", tmp_path, ("-DPROBE",))
    units = build.library_units("sm_90", "mcg", kernels="k3k4", extension=extra)
    assert [u.name for u in units] == [f"probe-{u.name}" for u in product]
    assert [u.defines for u in units] == [("-DPROBE", *u.defines) for u in product]
    commands = build.build_commands("sm_90", "mcg", kernels="k3k4", extension=extra)
    assert commands[0][-1] == str(tmp_path / "trellis_moe.cu")
    assert commands[-1][3] == "trellis_moe_probe_k3k4-sm_90-mcg.so"
    assert build.build_commands("sm_90", "mcg", kernels="k3k4")[0][-1] == str(build.kernel_source_dir() / "trellis_moe.cu")
    single = build.BuildExtension("whole", tmp_path, ("-DPROBE",), single_source="whole.cu")
    (unit,) = build.library_units("sm_90", "mcg", extension=single)
    assert (unit.name, unit.source, unit.defines) == ("whole-mcg", "whole.cu", ("-DPROBE", "-DTRELLIS_UNIT_CODEBOOK=1"))
    assert unit.seconds == sum(build.UNIT_SECONDS.values())
    assert build.unit_hash(unit, "sm_90", "13.0", tmp_path) != build.unit_hash(units[0], "sm_90", "13.0", tmp_path)
    with pytest.raises(UsageError, match="build extension name 'Lab-1'"):
        build.BuildExtension("Lab-1", tmp_path)
    with pytest.raises(UsageError, match="no missing.cu in"):
        build.BuildExtension("whole", tmp_path, single_source="missing.cu")


def test_spare_cores_go_to_the_longest_units_as_compiler_threads():
    units = build.library_units("sm_90", "mcg")
    threads = build.unit_threads(units, 16)
    longest = max(units, key=lambda u: u.seconds)
    assert threads[longest] == build.MAX_UNIT_THREADS
    assert {n for u, n in threads.items() if u.kind.endswith("k3k4") and u != longest} == {1}
    assert set(build.unit_threads(units, 2).values()) == {1}  # a full library on 2 cores: one thread each
    fast = build.library_units("sm_90", "mcg", kernels="k3k4")  # there the K3/K4 wgmma unit is most of it
    assert {u.kind: n for u, n in build.unit_threads(fast, 2).items() if n > 1} == {"wgmma-k3k4": 2}
    command = build.compile_command("nvcc", "sm_90", longest, build.kernel_source_dir(), Path("x.o"), threads=4)
    assert "-split-compile=4" in command
    # the threads do not change the code: the object's hash is the same however many a build gives it
    assert "-split-compile" not in " ".join(build.build_commands("sm_90")[0])


def test_a_change_rehashes_only_the_units_that_include_it(tmp_path: Path):
    sources = tmp_path / "kernels"
    shutil.copytree(build.kernel_source_dir(), sources)
    units = build.library_units("sm_90", "mcg")

    def hashes(arch="sm_90", version="13.0.88") -> dict[str, str]:
        return {u.name: build.unit_hash(u, arch, version, sources) for u in units}

    before = hashes()
    assert len(set(before.values())) == len(units)
    (sources / "activation.cuh").write_text((sources / "activation.cuh").read_text() + "\n// edited\n")
    changed = {n for n, h in hashes().items() if h != before[n]}
    assert changed == {"host"}  # only the host unit includes the activation
    (sources / "expert_wgmma.cuh").write_text((sources / "expert_wgmma.cuh").read_text() + "\n// edited\n")
    after_wgmma = hashes()
    assert after_wgmma["host"] == hashes()["host"] and all(after_wgmma[n] != before[n] for n in before)
    assert all(a != b for a, b in zip(hashes(version="13.1.0").values(), after_wgmma.values()))
    gemm_sources = build.unit_sources(sources, "gemm_unit.cu")
    assert gemm_sources == sorted(gemm_sources) and gemm_sources[0] == "abi.h"
    # expert_gemm.cuh's parts, followed through the includes
    assert {"expert_gemm.cuh", "gemm_tile.cuh", "copy_pipeline.cuh", "chunk_mma.cuh", "fc1.cuh", "fc2.cuh",
            "input_rotation.cuh", "handover.cuh"} <= set(gemm_sources)


def test_jobs_come_from_the_option_the_environment_or_the_cores(monkeypatch, capsys):
    monkeypatch.delenv("TRELLIS_BUILD_JOBS", raising=False)
    assert build.build_jobs() == os.cpu_count()
    monkeypatch.setenv("TRELLIS_BUILD_JOBS", "3")
    assert build.build_jobs() == 3 and build.build_jobs(5) == 5
    monkeypatch.setenv("TRELLIS_BUILD_JOBS", "many")
    code, _, err = run(["bench", "--compile-only", "--arch", "sm_80"], capsys)
    assert code == 2 and err.startswith("error: TRELLIS_BUILD_JOBS='many'")
    code, _, err = run(["bench", "--compile-only", "--arch", "sm_80", "--jobs", "0"], capsys)
    assert code == 2 and "build jobs must be at least 1" in err
    monkeypatch.delenv("TRELLIS_BUILD_JOBS")
    code, _, err = run(["bench", "--compile-only", "--codebook", "nosuch"], capsys)
    assert code == 2 and "unknown codebook 'nosuch'" in err


def test_cache_dir_follows_the_override_then_xdg(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("TRELLIS_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / "trellis" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "trellis" / "kernels"
    monkeypatch.setenv("TRELLIS_KERNEL_CACHE", str(tmp_path / "k"))
    assert build.cache_dir() == tmp_path / "k"


def test_missing_nvcc_is_a_gpu_error(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TRELLIS_NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "no-cuda"))
    # find_nvcc's last resort is the default toolkit location: hidden here, so the test also runs where a
    # toolkit is installed there.
    executable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith("/usr/local/cuda/") and executable(path, mode))
    with pytest.raises(GpuUnavailable, match="nvcc not found"):
        build.find_nvcc()


# ---------------------------------------------------------------------------------------------------------
# The build's process handling, with a stand-in compiler (tests/fake_nvcc.py) that hangs or burns CPU on cue.


def fake_nvcc(monkeypatch, tmp_path: Path, mode: str) -> Path:
    script = tmp_path / "nvcc"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_NVCC} {mode} {tmp_path / 'pids'} \"$@\"\n")
    script.chmod(0o755)
    monkeypatch.setenv("TRELLIS_NVCC", str(script))
    return tmp_path / "pids"


def test_a_stalled_compiler_is_killed_and_named(monkeypatch, tmp_path: Path, cache: Path, capsys):
    pids = fake_nvcc(monkeypatch, tmp_path, "hang")
    monkeypatch.setenv("TRELLIS_BUILD_STALL_S", "1.5")
    started = time.monotonic()
    code, out, err = run(["bench", "--compile-only", "--arch", "sm_80", "--codebook", "mcg", "--jobs", "2"], capsys)
    assert code == 4 and out == "" and time.monotonic() - started < 30
    assert "kernel build stalled: nvcc for sm_80 unit" in err and "used no CPU time for 2 s" in err
    time.sleep(0.5)
    for pid in pids.read_text().split():  # the stalled compiler and the one beside it are gone
        assert not Path("/proc", pid).exists() or "Z" in Path("/proc", pid, "stat").read_text().split(")")[1][:3]
    assert not list(cache.rglob("*.tmp")) and not list(cache.rglob("*.o"))


def test_a_slow_busy_compiler_is_never_timed_out(monkeypatch, tmp_path: Path):
    fake_nvcc(monkeypatch, tmp_path, "busy")  # computes for 0.8 s: longer than the stall limit
    output = tmp_path / "unit.o"
    job = Job("sm_80 unit busy", [os.environ["TRELLIS_NVCC"], "-c", "-o", str(tmp_path / "unit.o.tmp")],
              tmp_path / "unit.o.tmp", output)
    run_jobs([job], parallel=1, stall_s=0.3)
    assert output.read_bytes() == b"fake object\n" and not (tmp_path / "unit.o.tmp").exists()


def test_progress_on_stderr_and_every_unit_cached(monkeypatch, tmp_path: Path, cache: Path, capsys):
    fake_nvcc(monkeypatch, tmp_path, "quick")
    argv = ["bench", "--compile-only", "--arch", "sm_80", "--codebook", "mcg", "--json"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["units"] == doc["compiled"] == 7 and doc["libraries"][0]["codebook"] == "mcg"
    lines = err.strip().splitlines()
    assert re.search(r"compiling 7 of 7 units, \d+ at a time .*a cold build of these takes about", lines[1])
    assert [int(re.match(r"kernel build: (\d)/7 units, \S+ took \d+ s, .* elapsed$", l).group(1))
            for l in lines[2:9]] == list(range(1, 8))
    assert len(list((cache / "objects").glob("*.o"))) == 7 and not list(cache.rglob("*.tmp"))
    code, out, err = run(argv, capsys)
    assert json.loads(out)["compiled"] == 0 and json.loads(out)["libraries"][0]["cached"]
    assert "units" not in err  # nothing compiled, nothing to report
    code, out, _ = run(["bench", "--compile-only", "--arch", "sm_80", "--codebook", "3inst", "--json"], capsys)
    assert json.loads(out)["compiled"] == 6  # the host unit is shared: only 3inst's own units compile


# ---------------------------------------------------------------------------------------------------------
# The real compiler.


@requires_nvcc
def test_compile_error_carries_the_compiler_message(tmp_path: Path):
    broken = tmp_path / "broken.cu"
    broken.write_text("__global__ void k() { this_is_not_cuda; }\n")
    tmp, target = tmp_path / "out.o.tmp", tmp_path / "out.o"
    job = Job("sm_90 unit broken", [build.find_nvcc(), "-c", *build.arch_flags("sm_90"), "-o", str(tmp), str(broken)],
              tmp, target)
    with pytest.raises(GpuUnavailable) as info:
        run_jobs([job], parallel=1, stall_s=60)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("kernel build failed for sm_90 unit broken (nvcc exit")
    assert any("this_is_not_cuda" in line for line in lines[1:])
    assert not target.exists() and not tmp.exists()


@requires_nvcc
@pytest.mark.slow
def test_mcg_library_for_sm90_builds_cold_holds_its_kernels_and_is_cached(cache: Path, capsys):
    code, out, err = run(["bench", "--compile-only", "--arch", "sm_90", "--codebook", "mcg", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["arch"] == "sm_90" and doc["units"] == doc["compiled"] == 9
    assert "9/9 units" in err and "cold build of these takes about" in err
    library = Path(doc["libraries"][0]["path"])
    assert library.parent == cache and len(doc["libraries"][0]["build_hash"]) == 16
    assert kernel_symbols(library) == reference_symbols("sm_90", codebook=1)
    from trellis_cli.kernel.abi import load_library

    loaded = load_library(library, codebook="mcg")  # loading needs no GPU
    assert loaded.wgmma
    # The production library exports the C ABI of kernels/abi.h and nothing of the lab (lab/kernel/cuda/lab.h).
    assert {n for n in exported_functions(library) if n.startswith("trellis_")} == PRODUCTION_EXPORTS
    assert not hasattr(ctypes.CDLL(str(library)), "trellis_timeline_read")
    from lab.kernel.lab import load_lab_library

    with pytest.raises(GpuUnavailable, match="is not a lab build"):
        load_lab_library(library)
    code, out, err = run(["bench", "--compile-only", "--arch", "sm_90", "--codebook", "mcg", "--json"], capsys)
    assert json.loads(out)["compiled"] == 0 and json.loads(out)["libraries"][0]["path"] == str(library)


@pytest.fixture
def full_cache(kernel_build_lock) -> Path:
    """Where the complete builds go: the run's shared kernel cache (conftest.py), held while building."""
    return kernel_build_lock


@requires_nvcc
@pytest.mark.slow
# What CI's --compile-only builds: every codebook and kernel for sm_90; for sm_80 (the same sources without
# wgmma, whose arch branches every unit includes) mcg's K3/K4 kernels.
@pytest.mark.parametrize("arch, codebooks, kernels", [("sm_80", ("mcg",), "k3k4"), ("sm_90", build.BUILD_ORDER, "all")])
def test_every_kernel_of_the_single_unit_library_is_built_once(arch, codebooks, kernels, full_cache: Path,
                                                                monkeypatch):
    monkeypatch.setenv("TRELLIS_KERNEL_CACHE", str(full_cache))
    report = build.build_libraries(arch, codebooks, kernels=kernels)
    assert [lib.codebook for lib in report.libraries] == list(codebooks)
    objects = [p for u, p in _unit_objects(arch, full_cache, codebooks, kernels)]
    per_object = [kernel_symbols(p) for p in objects]
    assert sum(len(s) for s in per_object) == len(set().union(*per_object))  # no kernel in two units
    ids = [build.CODEBOOK_IDS[c] for c in codebooks]
    assert set().union(*per_object) == set().union(*(reference_symbols(arch, i, kernels) for i in ids))
    for lib in report.libraries:
        assert kernel_symbols(lib.path) == reference_symbols(arch, build.CODEBOOK_IDS[lib.codebook], kernels)


def _unit_objects(arch: str, cache: Path, codebooks=build.BUILD_ORDER, kernels: str = "all"):
    version = build.nvcc_version(build.find_nvcc())
    units = {u for c in codebooks for u in build.library_units(arch, c, kernels=kernels)}
    for unit in units:
        path = cache / "objects" / f"{unit.name}-{arch}-{build.unit_hash(unit, arch, version, build.kernel_source_dir())}.o"
        assert path.is_file(), path
        yield unit, path


@requires_gpu
@pytest.mark.gpu
def test_a_library_without_the_layers_codebook_refuses_it():
    # The mcg library the GPU tests share (tests/kernel/test_kernel_gpu.py builds it too): no second cold build.
    from trellis_cli.bench.synthetic import Preset, synthetic_pack
    from trellis_cli.errors import CheckFailed
    from trellis_cli.kernel.abi import default_library, load_library
    from trellis_cli.kernel.launch import FusedMoe

    mcg = default_library("mcg")
    pack = synthetic_pack(Preset("small", 512, 256, 16, 4, "3inst", (12, 4), (3, 4), 1), device="cuda", seed=1)
    with pytest.raises(CheckFailed, match="holds the mcg codebook's kernels; layer 0 uses 3inst"):
        FusedMoe(pack, mcg)
    # The library itself refuses too, when nothing told Python which codebook it holds.
    import torch

    unnamed = FusedMoe(pack, load_library(mcg.path))
    x = torch.zeros(2, 512, dtype=torch.float16, device="cuda")
    ids = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(CheckFailed, match="linked without the 3inst codebook's K3/K4 kernels"):
        unnamed.forward(x, ids, torch.ones(2, 4, device="cuda"))


@requires_gpu
@pytest.mark.gpu
def test_a_k3k4_library_refuses_a_layer_of_other_k_and_serves_k3k4():
    import torch

    from trellis_cli.bench.synthetic import Preset, synthetic_pack
    from trellis_cli.errors import CheckFailed
    from trellis_cli.kernel.abi import default_library, load_library
    from trellis_cli.kernel.launch import FusedMoe

    fast = default_library("mcg", kernels="k3k4")
    assert fast.kernels == "k3k4" and "_k3k4-" in fast.path.name
    k2 = synthetic_pack(Preset("small", 512, 256, 16, 4, "mcg", (12, 4), (2, 4), 1), device="cuda", seed=1)
    with pytest.raises(CheckFailed, match="holds only the K3/K4 kernels; layer 0 has tiers of K \\[2, 4\\]"):
        FusedMoe(k2, fast)
    x = torch.randn(2, 512, dtype=torch.float16, device="cuda")
    ids = torch.tensor([[0, 1, 2, 13], [3, 4, 14, 15]], dtype=torch.int32, device="cuda")
    with pytest.raises(CheckFailed, match="linked without the mcg codebook's all-K kernels"):  # unnamed: the library refuses
        FusedMoe(k2, load_library(fast.path)).forward(x, ids, torch.ones(2, 4, device="cuda"))
    k3k4 = synthetic_pack(Preset("small", 512, 256, 16, 4, "mcg", (12, 4), (3, 4), 1), device="cuda", seed=1)
    assert FusedMoe(k3k4).library.kernels == "k3k4"  # a layer's own default: the smallest set that serves it
    served = FusedMoe(k3k4, fast).forward(x, ids, torch.ones(2, 4, device="cuda"))
    full = FusedMoe(k3k4, default_library("mcg")).forward(x, ids, torch.ones(2, 4, device="cuda"))
    assert torch.equal(served, full)
