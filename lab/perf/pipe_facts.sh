#!/usr/bin/env bash
# The pipe facts of the decode's instructions on the GPU (docs/kernel.md "The decode budget"): the
# probe's SASS check, its timed run (clock64 per SM), ncu's per-pipe counters of every probe case, and
# the same counters over the production library's FC1/FC2 kernels at M = 1 and 512.
#   lab/perf/pipe_facts.sh [probe] [decode]      (default both; about 2-3 minutes on an H200)
# The probe builds as  nvcc -O3 -std=c++17 -arch=sm_90a -o pipe_facts lab/perf/probes/pipe_facts.cu
# Everything goes to $OUT (default ./out), in three files: pipe_facts.md (the tables), pipe_facts.log
# (the console) and raw.tar.gz (SASS, SASS check, CSVs, ncu reports and logs, the timed runs).
# The kernel cache may be carried in ./.kcache (XDG_CACHE_HOME) to skip the library's nvcc build.
set -u
OUT=${OUT:-./out}
raw=$OUT/raw
mkdir -p "$raw"
exec > >(tee "$OUT/pipe_facts.log") 2>&1
steps=${*:-probe decode}
want() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$PWD/.kcache
. lab/perf/ncu_pipes.sh
bin=$(mktemp -d)
md=$OUT/pipe_facts.md
gpu=$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -n 1)
printf '# Pipe facts\n\nGPU: %s; %s; ncu: %s\n\n' "$gpu" "$(nvcc --version | tail -n 1)" \
  "$([[ -n $NCU ]] && "$NCU" --version | tail -n 1 || echo none)" | tee "$md"
section() { printf '\n## %s\n\n' "$1" >> "$md"; }
code() { { echo '```'; cat "$1"; echo '```'; } >> "$md"; }

if want probe; then
  nvcc -O3 -std=c++17 -arch=sm_90a -o "$bin/pipe_facts" lab/perf/probes/pipe_facts.cu || exit 1
  nvcc -O3 -arch=sm_90a -o "$bin/pipe_mix" lab/perf/probes/pipe_mix.cu
  "$bin/pipe_facts" --list > "$raw/cases.tsv"
  cuobjdump -sass "$bin/pipe_facts" > "$raw/pipe_facts.sass"
  python3 lab/perf/pipe_facts.py sass "$raw/pipe_facts.sass" "$raw/cases.tsv" > "$raw/sass_check.tsv"
  awk -F'\t' 'NR > 1 && $2 != "ok" {print "SASS check:", $1, $2}' "$raw/sass_check.tsv"
  # pipe_mix.cu's own lop3, imad and lop3+imad kernels (MIX 1, 2, 3), beside their copies pf_pm_*
  cuobjdump -sass "$bin/pipe_mix" > "$raw/pipe_mix.sass"
  { printf 'case\tpayload_per_warp\twarps_per_sm\tsass\n'; printf '%s\t0\t64\t%s\n' _Z3mixILi1EEvPjj LOP3.LUT \
    _Z3mixILi2EEvPjj IMAD _Z3mixILi3EEvPjj 'IMAD LOP3.LUT'; } > "$raw/pipe_mix_cases.tsv"
  python3 lab/perf/pipe_facts.py sass "$raw/pipe_mix.sass" "$raw/pipe_mix_cases.tsv" | tee "$raw/pipe_mix_sass.tsv"
  "$bin/pipe_facts" | tee "$raw/wall.txt"
  "$bin/pipe_mix" | tee "$raw/pipe_mix.txt"
  (OUT=$raw; ncu_pipes probe --kernel-name regex:'^pf_' -- "$bin/pipe_facts" --once)
  section "Probe cases (ncu, per SM per active cycle; wall: payload per SM clock from the timed run)"
  python3 lab/perf/pipe_facts.py table "$raw/probe.csv" --sass "$raw/sass_check.tsv" --wall "$raw/wall.txt" \
    >> "$md" || { echo "no ncu table: the SASS check and the timed run alone" >> "$md"; code "$raw/sass_check.tsv"; }
  section "Timed run (clock64 per SM and attribute clock)"
  code "$raw/wall.txt"
  section "pipe_mix.cu as built: its SASS loops and its own output"
  code "$raw/pipe_mix_sass.tsv"
  code "$raw/pipe_mix.txt"
fi

if want decode; then
  python3 -c "from trellis_cli.kernel.abi import default_library as d; l = d(); print('kernel', l.build_hash, l.path)"
  for m in 1 512; do
    OUT=$raw lab/perf/ncu_phases.sh --pipes "$m"
    section "Production FC1/FC2 at M=$m (second eager call, lab/perf/profile_once.py)"
    if [[ -s $raw/ncu_pipes_m$m.md ]]; then cat "$raw/ncu_pipes_m$m.md" >> "$md"; else echo "ncu failed: see raw/ncu_pipes_m$m.log" >> "$md"; fi
  done
fi
tar -czf "$OUT/raw.tar.gz" -C "$OUT" raw && rm -rf "$raw" "$bin"
echo "wrote $md, $OUT/pipe_facts.log, $OUT/raw.tar.gz"
exec >&- 2>&-  # let tee see the end of the log and finish it
wait
