"""The pipe-facts probe's SASS check, ncu metric list and result table (lab/perf/pipe_facts.sh runs it):

    python3 lab/perf/pipe_facts.py sass PROBE.sass CASES.tsv > sass_check.tsv   # the loop of every case
    python3 lab/perf/pipe_facts.py metrics QUERY.txt [all|core]  # the valid metrics, comma-separated
    python3 lab/perf/pipe_facts.py table RAW.csv [--sass sass_check.tsv] [--wall wall.txt]
    python3 lab/perf/pipe_facts.py selftest

PROBE.sass is `cuobjdump -sass` of the probe, CASES.tsv its `--list`, QUERY.txt `ncu --query-metrics`,
RAW.csv `ncu --import REP --csv --page raw` (or the details page), wall.txt the probe's timed run.
"""

import csv
import io
import re
import sys
from collections import Counter

PIPE = "sm__inst_executed_pipe_"
# Wanted even when the query lists nothing (an older ncu, or the query failed): the shell retries without
# the optional ones when ncu refuses the list.
CORE = ["gpu__time_duration.sum", "sm__inst_executed.avg.per_cycle_active", "smsp__issue_active.avg.per_cycle_active",
        "sm__cycles_active.avg", "sm__cycles_elapsed.avg.per_second", "smsp__warps_active.avg.per_cycle_active", "launch__registers_per_thread",
        *(f"{PIPE}{p}.avg.per_cycle_active" for p in ("alu", "fma", "fmaheavy", "fmalite", "fp16", "xu")),
        *(f"sm__pipe_{p}_cycles_active.avg.pct_of_peak_sustained_active" for p in ("alu", "fma", "fmaheavy"))]
STALL = re.compile(r"^smsp__average_warps_issue_stalled_([a-z0-9_]+)_per_issue_active$")
INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);")
BRANCH = re.compile(r"0x([0-9a-f]+)")


# ---- SASS: the main loop of every function
def functions(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """name -> [(address, opcode, operands)] from cuobjdump -sass."""
    out, name = {}, None
    for line in text.splitlines():
        if "Function :" in line:
            name = line.split("Function :", 1)[1].strip()
            out[name] = []
        elif name and (m := INSTR.match(line)):
            out[name].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def main_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the longest backward branch's body (the whole function if none)."""
    best = code
    spans = []
    for addr, op, args in code:
        if op.startswith("BRA") and (m := BRANCH.search(args)) and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    if spans:
        lo, hi = max(spans, key=lambda s: s[1] - s[0])
        best = [c for c in code if lo <= c[0] <= hi]
    return best


def check(expect: str, seen: Counter) -> str:
    """'ok', or what is missing: expect is 'OP=N OP2=M' (A|B: either counts; no =N: present)."""
    problems = []
    for item in expect.split():
        ops, _, count = item.partition("=")
        found = sum(seen[o] for o in ops.split("|"))
        if count and found != int(count):
            problems.append(f"{ops}: {found} of {count}" + (" (opcode not emitted)" if not found else ""))
        elif not count and not found:
            problems.append(f"{ops}: opcode not emitted")
    return "ok" if not problems else "; ".join(problems)


def sass_check(sass_text: str, cases_text: str) -> list[dict]:
    funcs = functions(sass_text)
    rows = []
    for case in csv.DictReader(io.StringIO(cases_text), delimiter="\t"):
        code = funcs.get(case["case"])
        if code is None:
            rows.append({"case": case["case"], "verdict": "kernel not in the SASS", "loop": ""})
            continue
        loop = main_loop(code)
        seen = Counter(op for _, op, _ in loop)
        reuse = sum(args.count(".reuse") for _, _, args in loop)
        hist = " ".join(f"{op}×{n}" for op, n in seen.most_common())
        rows.append({"case": case["case"], "verdict": check(case["sass"], seen),
                     "loop": f"{hist} ({len(loop)} instr, {reuse} reuse)"})
    return rows


# ---- metrics: what to ask ncu for
def query_names(text: str) -> set[str]:
    """Base metric names from `ncu --query-metrics` output."""
    return {m.group(0) for line in text.splitlines() if (m := re.match(r"[a-z][a-z0-9_]*__[a-z0-9_]+", line))}


def wanted_metrics(query_text: str, core_only: bool = False) -> list[str]:
    names = query_names(query_text)
    if not names:
        return list(CORE)
    out = [m for m in CORE if m.split(".")[0] in names or m.startswith("launch__")]
    if core_only:
        return out
    out += sorted(f"{n}.avg.per_cycle_active" for n in names
                  if n.startswith(PIPE) and not n.endswith("_pred_on") and f"{n}.avg.per_cycle_active" not in out)
    out += sorted(f"{n}.avg.pct_of_peak_sustained_active" for n in names
                  if re.fullmatch(r"sm__pipe_[a-z0-9_]+_cycles_active", n)
                  and f"{n}.avg.pct_of_peak_sustained_active" not in out)
    out += sorted(f"{n}.ratio" for n in names if STALL.match(n))
    return out


# ---- table: ncu CSV -> markdown
def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def read_ncu_csv(text: str) -> list[tuple[str, dict[str, float]]]:
    """[(kernel, {metric: value})] in launch order, from the raw page (one row per launch, a units row
    after the header) or the details page (one row per metric)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    reader = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    launches: dict[str, tuple[str, dict]] = {}
    for row in reader:
        launch = row.get("ID", "")
        if not launch or number(launch) is None:
            continue  # the units row
        name, values = launches.setdefault(launch, (row.get("Kernel Name", "?"), {}))
        if "Metric Name" in row:
            if (v := number(row.get("Metric Value", ""))) is not None:
                values[row["Metric Name"]] = v
        else:
            values.update({k: v for k, t in row.items() if "__" in (k or "") and (v := number(t)) is not None})
    return [launches[k] for k in sorted(launches, key=lambda k: number(k))]


def short(name: str) -> str:
    name = re.sub(r"^void\s+", "", name)
    return name if len(name) <= 70 else name[:67] + "..."


def get(values: dict, prefix: str) -> float | None:
    """The value of a metric by its name up to the suffix (the suffix the query chose)."""
    return next((v for k, v in values.items() if k.split(".")[0] == prefix), None)


def fmt(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def which_pipes(values: dict, issued: float | None) -> str:
    rates = {k.split(".")[0][len(PIPE):]: v for k, v in values.items() if k.startswith(PIPE) and v}
    if "fmaheavy" in rates or "fmalite" in rates:
        rates.pop("fma", None)  # the sum of the two
    total = issued or sum(rates.values()) or 1.0
    parts = [f"{p} {100 * v / total:.0f}%" for p, v in sorted(rates.items(), key=lambda kv: -kv[1])
             if v >= 0.05 * total]
    return ", ".join(parts) or "–"


def top_stalls(values: dict, n: int = 2) -> str:
    stalls = {m.group(1): v for k, v in values.items() if (m := STALL.match(k.split(".")[0])) and v > 0.05}
    stalls.pop("selected", None)
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:n]) or "–"


def read_wall(text: str) -> dict[str, str]:
    """case -> warp instructions per clock per SM from the probe's timed run (clock64 per SM)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[0].startswith("pf_") and number(parts[3]) is not None:
            out[parts[0]] = f"{parts[3]} (attr {parts[4]}, {parts[1]} w)"
    return out


def table(launches, sass: dict[str, dict] | None = None, wall: dict[str, str] | None = None) -> str:
    sass, wall = sass or {}, wall or {}
    head = ["case", "SASS in the loop (check)", "µs", "issued/SM/clk", "ALU", "FMA", "FMA-heavy", "FMA-lite", "FP16",
            "XU", "ALU busy %", "FMA-heavy busy %", "which pipe", "top stalls per issue", "warps/SMSP", "MHz",
            "wall/SM/clk"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in launches:
        case = short(name)
        check = sass.get(name, {})
        seen = check.get("loop", "–") + ("" if check.get("verdict", "ok") == "ok" else f" **{check['verdict']}**")
        issued = get(v, "sm__inst_executed")
        ns = get(v, "gpu__time_duration")
        cells = [case, seen if check else "–", fmt(ns / 1e3 if ns else None, 1), fmt(issued)]
        cells += [fmt(get(v, PIPE + p)) for p in ("alu", "fma", "fmaheavy", "fmalite", "fp16", "xu")]
        cells += [fmt(get(v, "sm__pipe_alu_cycles_active"), 1), fmt(get(v, "sm__pipe_fmaheavy_cycles_active"), 1)]
        mhz = get(v, "sm__cycles_elapsed")
        cells += [which_pipes(v, issued), top_stalls(v), fmt(get(v, "smsp__warps_active"), 1),
                  fmt(mhz / 1e6 if mhz else None, 0), wall.get(name, "–")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def read_tsv(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {r["case"]: r for r in csv.DictReader(f, delimiter="\t")}


def selftest() -> None:
    sass = """\t\tFunction : pf_x
        /*0000*/                   IMAD R1, R2, R3, R4 ;      /* 0x0 */
        /*0010*/                   LOP3.LUT R5, R5, R2.reuse, R3, 0x6a, !PT ;  /* 0x0 */
        /*0020*/                   IMAD R1, R2, R3, R4 ;      /* 0x0 */
        /*0030*/               @P0 BRA 0x10 ;                 /* 0x0 */
        /*0040*/                   EXIT ;                     /* 0x0 */
"""
    rows = sass_check(sass, "case\tpayload_per_warp\twarps_per_sm\tsass\npf_x\t1\t64\tIMAD=1 LOP3.LUT=1\n")
    assert rows[0]["verdict"] == "ok" and "1 reuse" in rows[0]["loop"], rows
    assert "opcode not emitted" in check("SHF.L.U32|IMAD.SHL.U32=2", Counter())
    raw = ('"ID","Kernel Name","sm__inst_executed.avg.per_cycle_active","sm__inst_executed_pipe_alu.avg.per_cycle_active",'
           '"sm__inst_executed_pipe_fmaheavy.avg.per_cycle_active"\n"","","inst/cycle","inst/cycle","inst/cycle"\n'
           '"0","pf_x","3,99","1.99","2.00"\n')
    launches = read_ncu_csv(raw.replace("3,99", "3.99"))
    assert launches == [("pf_x", {"sm__inst_executed.avg.per_cycle_active": 3.99,
                                  "sm__inst_executed_pipe_alu.avg.per_cycle_active": 1.99,
                                  "sm__inst_executed_pipe_fmaheavy.avg.per_cycle_active": 2.0})], launches
    text = table(launches, {r["case"]: r for r in rows})
    assert "fmaheavy 50%, alu 50%" in text and "LOP3.LUT×1 IMAD×1 BRA×1" in text, text
    long = ('"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","k","Command line profiler metrics","sm__inst_executed.avg.per_cycle_active","inst/cycle","1,024.5"\n')
    assert read_ncu_csv(long) == [("k", {"sm__inst_executed.avg.per_cycle_active": 1024.5})]
    query = "Device NVIDIA H200 (GH100)\nMetric Name  Description\nsm__inst_executed_pipe_alu  # of warp instr\n"
    assert f"{PIPE}alu.avg.per_cycle_active" in wanted_metrics(query)
    assert f"{PIPE}fmaheavy.avg.per_cycle_active" not in wanted_metrics(query)
    assert wanted_metrics("") == CORE and "launch__registers_per_thread" in wanted_metrics(query, core_only=True)
    wall = read_wall("case warps ms a b c\npf_x                          64     1.060        3.987        3.001     1490\n")
    assert wall == {"pf_x": "3.987 (attr 3.001, 64 w)"}, wall
    print("selftest ok")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("sass", "metrics", "table", "selftest"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "selftest":
        selftest()
    elif argv[0] == "sass":
        rows = sass_check(open(argv[1]).read(), open(argv[2]).read())
        print("case\tverdict\tloop")
        for r in rows:
            print(f"{r['case']}\t{r['verdict']}\t{r['loop']}")
    elif argv[0] == "metrics":
        try:
            text = open(argv[1]).read() if len(argv) > 1 else ""
        except OSError:
            text = ""
        print(",".join(wanted_metrics(text, core_only=argv[2:3] == ["core"])))
    else:
        opts = dict(zip(argv[2::2], argv[3::2]))
        try:
            sass = read_tsv(opts["--sass"]) if "--sass" in opts else None
            wall = read_wall(open(opts["--wall"]).read()) if "--wall" in opts else None
            launches = read_ncu_csv(open(argv[1]).read())
        except OSError as err:
            print(f"{err.filename}: {err.strerror}", file=sys.stderr)
            return 1
        if not launches:
            print(f"{argv[1]}: no ncu rows (no line starting with \"ID\")", file=sys.stderr)
            return 1
        sys.stdout.write(table(launches, sass, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
