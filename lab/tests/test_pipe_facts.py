"""lab/perf/pipe_facts.py: the pipe-facts probe's SASS check and ncu CSV -> table, on small synthetic files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "pipe_facts.py"

# cuobjdump -sass of two kernels: one whose loop holds what its case asks, one where ptxas chose another opcode.
SASS = """\t\tFunction : pf_imad__lop3
        /*0000*/                   S2R R0, SR_TID.X ;                               /* 0x0 */
        /*0010*/                   IMAD R1, R2.reuse, R1, R3 ;                      /* 0x0 */
        /*0020*/                   LOP3.LUT R4, R4, R2, R3, 0x6a, !PT ;             /* 0x0 */
        /*0030*/                   UIADD3 UR4, UR4, 0x1, URZ ;                      /* 0x0 */
        /*0040*/               @P0 BRA 0x10 ;                                       /* 0x0 */
        /*0050*/                   EXIT ;                                           /* 0x0 */
\t\tFunction : pf_imad_shl
        /*0000*/                   SHF.L.U32 R1, R1, 0x4, RZ ;                      /* 0x0 */
        /*0010*/               @P0 BRA 0x0 ;                                        /* 0x0 */
"""
CASES = ("case\tpayload_per_warp\twarps_per_sm\tsass\n"
         "pf_imad__lop3\t128\t64\tIMAD=1 LOP3.LUT=1\npf_imad_shl\t64\t64\tIMAD.SHL.U32=1\npf_gone\t1\t64\tIMAD\n")
RAW = ('"ID","Kernel Name","sm__inst_executed.avg.per_cycle_active","sm__inst_executed_pipe_alu.avg.per_cycle_active",'
       '"sm__inst_executed_pipe_fmaheavy.avg.per_cycle_active","sm__inst_executed_pipe_fma.avg.per_cycle_active"\n'
       '"","","inst/cycle","inst/cycle","inst/cycle","inst/cycle"\n'
       '"0","pf_imad__lop3","3.99","1.99","2.00","2.00"\n')


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_selftest_passes():
    assert run("selftest").stdout.strip() == "selftest ok"


def test_sass_check_names_missing_opcodes_and_kernels(tmp_path):
    (tmp_path / "p.sass").write_text(SASS)
    (tmp_path / "cases.tsv").write_text(CASES)
    out = run("sass", str(tmp_path / "p.sass"), str(tmp_path / "cases.tsv"))
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in out.stdout.splitlines()[1:]}
    assert rows["pf_imad__lop3"][0] == "ok"
    assert "IMAD×1 LOP3.LUT×1 UIADD3×1 BRA×1 (4 instr, 1 reuse)" in rows["pf_imad__lop3"][1]
    assert rows["pf_imad_shl"][0] == "IMAD.SHL.U32: 0 of 1 (opcode not emitted)"
    assert rows["pf_gone"][0] == "kernel not in the SASS"


def test_table_splits_issue_between_pipes(tmp_path):
    (tmp_path / "raw.csv").write_text("==PROF== Disconnected\n" + RAW)
    out = run("table", str(tmp_path / "raw.csv"))
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| pf_imad__lop3"))
    assert "| 3.99 | 1.99 | 2.00 | 2.00 |" in row and "fmaheavy 50%, alu 50%" in row


def test_table_without_csv_is_a_named_error(tmp_path):
    out = run("table", str(tmp_path / "missing.csv"))
    assert out.returncode == 1 and "missing.csv" in out.stderr and "Traceback" not in out.stderr
