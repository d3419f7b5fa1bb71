"""The lab stays out of the product: the product's kernels/ carry no hook (tests/kernel/test_kernel_build.py), the
lab's hooks reach a copy of them through hooks.patch (lab/kernel/sources.py) and the build's one extension point
(build.BuildExtension); the production ABI and API take no lab flags, the lab variants build apart, the oracles
live outside the launch path. The slow tests build the lab variants (nvcc, no GPU)."""

from __future__ import annotations

import ctypes
import inspect
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from lab.kernel import lab, sources
from trellis_cli.errors import GpuUnavailable
from trellis_cli.kernel import abi, build, plan
from trellis_cli.kernel.launch import FusedMoe

KERNELS = build.kernel_source_dir()
LAB_BLOCK = re.compile(r"^#ifdef TRELLIS_LAB\n.*?^#endif\n", re.M | re.S)
PRODUCTION_EXPORTS = {"trellis_abi_version", "trellis_has_wgmma", "trellis_args_size", "trellis_moe_forward",
                      "trellis_last_error"}


def have_nvcc() -> bool:
    try:
        build.find_nvcc()
    except GpuUnavailable:
        return False
    return True


requires_nvcc = pytest.mark.skipif(not have_nvcc(), reason="needs nvcc (CUDA toolkit)")


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """The lab's sources: kernels/ with hooks.patch applied and lab/kernel/cuda/ beside them."""
    into = tmp_path_factory.mktemp("lab-sources")
    sources.stage(into)
    return into


@pytest.fixture
def cache(monkeypatch, tmp_path: Path) -> Path:
    folder = tmp_path / "kcache"
    monkeypatch.setenv("TRELLIS_KERNEL_CACHE", str(folder))
    return folder


def test_the_hooks_patch_applies_to_the_product_sources_and_adds_only_lab_code(staged: Path):
    assert {p.name for p in sources.lab_files()} == {"lab.h", "timeline.cuh", "single_tu.cu"}
    for path in sources.product_files():
        before, after = path.read_text().splitlines(), (staged / path.name).read_text().splitlines()
        removed = [line for line in before if line not in after]
        assert removed == [] or path.name in ("activation.cuh", "gemm_unit.cu", "handover.cuh", "tile_kernels.cuh",
                                              "trellis_moe.cu"), (path.name, removed)
    # the patch is the difference from kernels/ to the staged copy (`refresh` rebuilds it), up to where its
    # hunks start: a kernel change that only moves a hook's lines needs no refresh
    def hunks(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("@@")]

    assert hunks(sources.hooks_patch(staged)) == hunks(sources.PATCH.read_text())
    assert "int32_t lab_flags;" in (staged / "abi.h").read_text()
    assert "trellis_timeline_read" in (staged / "trellis_moe.cu").read_text()


def test_a_patch_that_no_longer_applies_is_a_named_error(monkeypatch, tmp_path: Path):
    broken = tmp_path / "hooks.patch"
    broken.write_text("--- a/fc2.cuh\n+++ b/fc2.cuh\n@@ -1,2 +1,2 @@\n-no such line\n-nor this\n+x\n+y\n")
    monkeypatch.setattr(sources, "PATCH", broken)
    with pytest.raises(GpuUnavailable, match=r"(?s)hooks.patch no longer applies to kernels/.*fc2.cuh.*refresh"):
        sources.stage(tmp_path / "out")


def test_lab_flags_are_read_only_through_lab_flag_and_the_repair_only_in_the_lab_build(staged: Path):
    for path in sorted(staged.glob("*.cu*")) + sorted(staged.glob("*.h")):
        if path.name not in ("lab.h", "abi.h"):
            assert "lab_flags" not in path.read_text(), f"{path.name} reads lab_flags past lab_flag()"
    host = LAB_BLOCK.sub("", (staged / "trellis_moe.cu").read_text())
    assert "cudaMemsetAsync" not in host and "trellis_lab_build" not in host  # both under TRELLIS_LAB
    assert "#error" in (staged / "timeline.cuh").read_text()


def test_lab_constants_mirror_lab_header():
    defines = dict(re.findall(r"^#define TRELLIS_LAB_(\w+) (\d+)", (sources.CUDA / "lab.h").read_text(), re.M))
    assert {name: int(value) for name, value in defines.items()} == {
        name: getattr(lab, name) for name in defines
    }
    assert len(defines) == 9


def test_lab_arguments_are_the_production_ones_then_the_flags(staged: Path):
    text = (staged / "abi.h").read_text()
    body = text[text.index("typedef struct TrellisMoeArgs {"):text.index("} TrellisMoeArgs;")]
    fields = re.findall(r"^\s+(?:const )?\w+\*?\s+\*?(\w+)(?:\[\w+\])?;", body, flags=re.M)
    assert fields == [n for n, _ in lab.TrellisLabArgs._fields_]  # the lab's abi.h, field for field
    assert [n for n, _ in lab.TrellisLabArgs._fields_] == [n for n, _ in abi.TrellisMoeArgs._fields_] + ["lab_flags"]
    offset = lab.TrellisLabArgs.lab_flags.offset
    assert offset == abi.TrellisMoeArgs.fc1_tail_split.offset + 4  # right after the last production field
    # The tail padding may hold the flag (both 376 bytes today), so the loaders tell the builds apart by
    # the trellis_lab_build export, never by the size.
    assert ctypes.sizeof(lab.TrellisLabArgs) - ctypes.sizeof(abi.TrellisMoeArgs) in (0, 8)


def test_the_production_python_api_takes_no_lab_flags():
    assert not [n for n, _ in abi.TrellisMoeArgs._fields_ if "flag" in n]
    assert not [n for n in vars(abi) if n.startswith(("SKIP_", "NO_PDL", "WGMMA_", "FC2_WIDE"))]
    for method in (FusedMoe.forward, FusedMoe.two_pass, FusedMoe.__init__):
        assert not [p for p in inspect.signature(method).parameters if "flag" in p], method
    assert "lab_flags" in inspect.signature(lab.LabMoe.forward).parameters
    for name in ("route_pack_reference", "RoutePack", "route_combined", "plain_columns"):
        assert not hasattr(plan, name), name  # oracles: lab/kernel/oracle.py


def test_lab_variants_compile_the_same_units_apart_from_the_production_ones(cache: Path):
    production = build.library_units("sm_90", "mcg")
    labbed = build.library_units("sm_90", "mcg", extension=lab.extension("lab"))
    assert [u.name for u in labbed] == [f"lab-{u.name}" for u in production]
    assert all(u.defines == ("-DTRELLIS_LAB", *p.defines) for u, p in zip(labbed, production))
    assert [u.kind for u in labbed] == [u.kind for u in production]
    assert not [u for u in production if any("LAB" in d or "TIMELINE" in d for d in u.defines)]
    source_dir = sources.lab_source_dir()
    assert source_dir.parent == cache / "lab-sources" and sources.lab_source_dir() == source_dir  # staged once
    version = "13.0.88"
    product_hashes = {build.unit_hash(u, "sm_90", version, KERNELS) for u in production}
    assert not product_hashes & {build.unit_hash(u, "sm_90", version, source_dir) for u in labbed}
    (timeline,) = build.library_units("sm_90", "mcg", extension=lab.extension("timeline"))
    assert timeline.source == "single_tu.cu" and timeline.name == "timeline-mcg"
    assert timeline.defines == ("-DTRELLIS_LAB", "-DTRELLIS_TIMELINE", "-DTRELLIS_UNIT_CODEBOOK=1")
    assert [build.library_stem(extension=lab.extension(v)) for v in lab.LAB_VARIANTS] == [
        "trellis_moe_lab", "trellis_moe_timeline"]
    with pytest.raises(Exception, match="unknown lab variant"):
        lab.extension("debug")


def test_build_commands_are_the_builds_own(cache: Path):
    timeline = lab.extension("timeline")
    commands = build.build_commands("sm_90", "mcg", nvcc="nvcc", extension=timeline)
    (unit,) = build.library_units("sm_90", "mcg", extension=timeline)
    assert commands[0] == build.compile_command("nvcc", "sm_90", unit, timeline.source_dir, Path("timeline-mcg.o"))
    assert commands[-1] == ["nvcc", "-shared", "-o", "trellis_moe_timeline-sm_90-mcg.so", "timeline-mcg.o"]
    assert len(build.build_commands("sm_80", "mcg")) == 7 + 1  # 7 units, then the link


def test_every_kernel_header_is_under_500_lines():
    for path in sorted(KERNELS.glob("*.cuh")):
        assert len(path.read_text().splitlines()) < 500, path.name


def test_the_lab_entry_prints_the_builds_own_command_lines(monkeypatch, tmp_path, capsys, cache: Path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 1\n")  # never run: --commands builds nothing
    nvcc.chmod(0o755)
    monkeypatch.setenv("TRELLIS_NVCC", str(nvcc))
    assert lab.main(["--arch", "sm_90", "--variant", "lab", "--commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [shlex.join(c) for c in build.build_commands("sm_90", "mcg", nvcc=str(nvcc),
                                                                  extension=lab.extension("lab"))]
    assert len(lines) == 9 + 1 and all("-DTRELLIS_LAB" in line for line in lines[:-1])
    assert all(str(cache / "lab-sources") in line for line in lines[:-1])
    assert lab.main(["--arch", "sm_90", "--codebook", "nope", "--commands"]) == 2
    assert "unknown codebook 'nope'" in capsys.readouterr().err


def exported_functions(path: Path) -> set[str]:
    listing = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    return {parts[2] for parts in (line.split() for line in listing.stdout.splitlines())
            if len(parts) == 3 and parts[1] == "T" and parts[2].startswith("trellis_")}


@requires_nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
@pytest.mark.parametrize("variant, kernels, exports", [
    ("lab", "k3k4", {"trellis_lab_build"}),
    ("timeline", "all", {"trellis_lab_build", "trellis_timeline_read"}),  # lab/perf/timeline.py's build
])
def test_lab_variants_build_export_their_entries_and_only_the_lab_loader_takes_them(variant, kernels, exports,
                                                                                     cache: Path):
    built = build.build_library("sm_90", "mcg", kernels=kernels, extension=lab.extension(variant))
    assert built.path.parent == cache and built.path.name.startswith(f"trellis_moe_{variant}")
    assert built.extension == variant
    assert exported_functions(built.path) == PRODUCTION_EXPORTS | exports
    assert lab.load_lab_library(built.path).lab
    with pytest.raises(GpuUnavailable, match="is a lab build"):
        abi.load_library(built.path)
