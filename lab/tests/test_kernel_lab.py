"""The lab stays out of the product, checked on the sources (no compiler): the production ABI and API take no
lab flags, every lab branch compiles only under TRELLIS_LAB, the lab variants build apart, the oracles live
outside the launch path. The built libraries' exports are checked by the slow tests of test_kernel_build.py."""

from __future__ import annotations

import ctypes
import inspect
import re
import shlex

import pytest

from lab.kernel import lab
from trellis_cli.kernel import abi, build, plan
from trellis_cli.kernel.launch import FusedMoe

KERNELS = build.kernel_source_dir()
LAB_BLOCK = re.compile(r"^#ifdef TRELLIS_LAB\n.*?^#endif\n", re.M | re.S)


def source(name: str) -> str:
    return (KERNELS / name).read_text()


def without_lab_blocks(text: str) -> str:
    """The text a production build compiles: the `#ifdef TRELLIS_LAB` blocks cut out (they hold no
    nested #if, which the checks below need)."""
    for block in LAB_BLOCK.findall(text):
        assert "#if" not in block.split("\n", 1)[1], block
    return LAB_BLOCK.sub("", text)


def test_the_production_abi_header_declares_no_lab_flags():
    header = without_lab_blocks(source("abi.h"))
    assert not re.search(r"flag", header, re.I)
    assert not re.search(r"TRELLIS_(?:LAB|SKIP|NO_PDL|FC2_WIDE|WGMMA_NARROW|WGMMA_WIDE)", header)
    assert "int trellis_moe_forward(const TrellisMoeArgs* args, void* stream);" in header
    assert re.findall(r"^\s+int32_t lab_flags;", source("abi.h"), re.M)  # lab builds only
    assert not re.search(r"^\s+int32_t lab_flags;", header, re.M)


def test_lab_flags_are_read_only_through_lab_flag_and_the_repair_only_in_the_lab_build():
    for path in sorted(KERNELS.glob("*.cu*")) + sorted(KERNELS.glob("*.h")):
        text = path.read_text()
        assert "debug_flags" not in text and "TRELLIS_ONLY_MCG" not in text, path.name
        if path.name not in ("lab.h", "abi.h"):
            assert "lab_flags" not in text, f"{path.name} reads lab_flags past lab_flag()"
    host = without_lab_blocks(source("trellis_moe.cu"))
    assert "cudaMemsetAsync" not in host  # the hand-over repair after a skipped phase
    assert "trellis_lab_build" not in host
    assert "trellis_timeline_read" in source("trellis_moe.cu")
    # lab_flag is the constant false outside the lab build
    production = source("lab.h").split("#ifdef TRELLIS_LAB\n  return (a.lab_flags & flags) != 0;\n#else\n")[1]
    assert production.split("#endif")[0].strip().endswith("return false;")
    assert "#error" in source("timeline.cuh") and "!defined(TRELLIS_LAB)" in source("timeline.cuh")


def test_lab_constants_mirror_lab_header():
    defines = dict(re.findall(r"^#define TRELLIS_LAB_(\w+) (\d+)", source("lab.h"), re.M))
    assert {name: int(value) for name, value in defines.items()} == {
        name: getattr(lab, name) for name in defines
    }
    assert len(defines) == 9


def test_lab_arguments_are_the_production_ones_then_the_flags():
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


def test_lab_variants_compile_the_same_units_apart_from_the_production_ones():
    production = build.library_units("sm_90", "mcg")
    labbed = build.library_units("sm_90", "mcg", "lab")
    assert [u.name for u in labbed] == [f"lab-{u.name}" for u in production]
    assert all(u.defines == ("-DTRELLIS_LAB", *p.defines) for u, p in zip(labbed, production))
    assert [u.kind for u in labbed] == [u.kind for u in production]
    assert not [u for u in production if any("LAB" in d or "TIMELINE" in d for d in u.defines)]
    version, hashes = "13.0.88", lambda units: {build.unit_hash(u, "sm_90", version, KERNELS) for u in units}
    assert not hashes(production) & hashes(labbed)
    (timeline,) = build.library_units("sm_90", "mcg", "timeline")
    assert timeline.source == "single_tu.cu" and timeline.name == "timeline-mcg"
    assert timeline.defines == ("-DTRELLIS_LAB", "-DTRELLIS_TIMELINE", "-DTRELLIS_UNIT_CODEBOOK=1")
    assert [build.library_stem(v) for v in build.VARIANT_DEFINES] == [
        "trellis_moe", "trellis_moe_lab", "trellis_moe_timeline"]
    with pytest.raises(Exception, match="unknown kernel library variant"):
        build.library_units("sm_90", "mcg", "debug")


def test_build_commands_are_the_builds_own():
    commands = build.build_commands("sm_90", "mcg", "timeline", nvcc="nvcc")
    (unit,) = build.library_units("sm_90", "mcg", "timeline")
    assert commands[0] == build.compile_command("nvcc", "sm_90", unit, KERNELS, build.Path("timeline-mcg.o"))
    assert commands[-1] == ["nvcc", "-shared", "-o", "trellis_moe_timeline-sm_90-mcg.so", "timeline-mcg.o"]
    assert len(build.build_commands("sm_80", "mcg")) == 7 + 1  # 7 units, then the link


def test_every_kernel_header_is_under_500_lines():
    for path in sorted(KERNELS.glob("*.cuh")):
        assert len(path.read_text().splitlines()) < 500, path.name


def test_the_lab_entry_prints_the_builds_own_command_lines(monkeypatch, tmp_path, capsys):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 1\n")  # never run: --commands builds nothing
    nvcc.chmod(0o755)
    monkeypatch.setenv("TRELLIS_NVCC", str(nvcc))
    assert lab.main(["--arch", "sm_90", "--variant", "lab", "--commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [shlex.join(c) for c in build.build_commands("sm_90", "mcg", "lab", nvcc=str(nvcc))]
    assert len(lines) == 9 + 1 and all("-DTRELLIS_LAB" in line for line in lines[:-1])
    assert lab.main(["--arch", "sm_90", "--codebook", "nope", "--commands"]) == 2
    assert "unknown codebook 'nope'" in capsys.readouterr().err
