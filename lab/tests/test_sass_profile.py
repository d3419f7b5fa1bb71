"""lab/perf/sass_profile.py: ncu's source-page CSV summed by opcode and by straight-line block."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "sass_profile.py"

# The shape ncu writes with --page source --csv --print-source sass: its own log lines, the kernel's name,
# one header row and one row per SASS instruction (thousands separators in the counts).
NCU_CSV = """==PROF== Connected to process 1
"Kernel Name","void trellis::fc2_wgmma_kernel<(int)1, (bool)1, (int)64>(TrellisMoeArgs)",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Thread Instructions Executed"
"0x7f0000000010","LOP3.LUT R3, R2, 0xffff, RZ, 0xc0, !PT","5","1,000","32,000"
"0x7f0000000000","S2R R0, SR_TID.X","1","10","320"
"0x7f0000000020","IMAD R4, R3, -0x3453e013, RZ","7","1,000","32,000"
"0x7f0000000030","@!P0 LDS.U16 R5, [R4]","2","1,000","32,000"
"0x7f0000000040","BAR.SYNC.DEFER_BLOCKING 0x0","20","10","320"
==PROF== Disconnected from process 1
"""


def load_script():
    spec = importlib.util.spec_from_file_location("sass_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_opcode_drops_guard_and_modifiers():
    sass_profile = load_script()
    assert sass_profile.opcode("@!P0 LDS.U16 R5, [R4]") == "LDS"
    assert sass_profile.opcode("IMAD.WIDE.U32 R2, R3, 0x4, R4") == "IMAD"
    assert sass_profile.opcode("") == "?"


def test_lines_in_address_order_and_blocks_by_equal_counts(tmp_path: Path):
    sass_profile = load_script()
    path = tmp_path / "fc2.csv"
    path.write_text(NCU_CSV)
    kernel, lines = sass_profile.read_lines(str(path))
    assert kernel.startswith("void trellis::fc2_wgmma_kernel")
    assert [line.opcode for line in lines] == ["S2R", "LOP3", "IMAD", "LDS", "BAR"]
    assert [line.executed for line in lines] == [10, 1000, 1000, 1000, 10]
    blocks = sass_profile.blocks_of(lines)
    assert [(b.executed, b.length, b.samples) for b in blocks] == [(10, 1, 1), (1000, 3, 14), (10, 1, 20)]
    assert blocks[1].opcodes == {"LOP3": 1, "IMAD": 1, "LDS": 1}


def test_command_reports_instructions_per_weight(tmp_path: Path):
    path = tmp_path / "fc2.csv"
    path.write_text(NCU_CSV)
    # 3,020 warp instructions over 32,000 weights: 3.02 per weight and lane (x 32 / weights).
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--weights", "32000"], capture_output=True,
                         text=True, check=True).stdout
    assert "3,020 warp instructions, 3.02 per decoded weight" in out
    lines = out.splitlines()
    opcode_rows = {line.split()[0]: line.split()[1:] for line in lines[lines.index("") + 2:] if line.strip()}
    assert opcode_rows["LOP3"] == ["1.000", "14.3"]  # 1,000 x 32 / 32,000; 5 of 35 stall samples
    assert opcode_rows["BAR"] == ["0.010", "57.1"]


def test_command_names_a_file_that_is_no_source_page(tmp_path: Path):
    path = tmp_path / "log.csv"
    path.write_text("==PROF== Connected to process 1\n==ERROR== the profiled process failed\n")
    run = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert run.returncode == 1
    assert f"{path}: no ncu source page" in run.stderr and "Traceback" not in run.stderr
