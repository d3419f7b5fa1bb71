# Sourced by pipe_facts.sh and ncu_phases.sh: ncu with the pipe metrics of pipe_facts.py, asking only
# for the metrics this ncu and GPU know (`ncu --query-metrics`), and once more with the core set alone
# when ncu refuses the list. Needs OUT and the repository root as the working directory.
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)}

ncu_pipes() {  # ncu_pipes NAME [ncu options...] -- CMD...: $OUT/NAME.ncu-rep, $OUT/NAME.csv, $OUT/NAME.log
  local name=$1 opts=() set metrics rc=1
  shift
  while [[ $# -gt 0 && $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  [[ -n $NCU ]] || { echo "ncu not found: no $name"; return 1; }
  [[ -s $OUT/ncu_query.txt ]] || "$NCU" --query-metrics > "$OUT/ncu_query.txt" 2>&1
  : > "$OUT/$name.log"
  for set in all core; do
    metrics=$(python3 lab/perf/pipe_facts.py metrics "$OUT/ncu_query.txt" "$set")
    echo "ncu $name ($set): $metrics" >> "$OUT/$name.log"
    timeout "${NCU_TIMEOUT:-150}" "$NCU" --clock-control none --metrics "$metrics" "${opts[@]}" \
      -f -o "$OUT/$name" "$@" >> "$OUT/$name.log" 2>&1
    rc=$?
    [[ $rc -eq 0 && -s $OUT/$name.ncu-rep ]] && break
    echo "ncu $name ($set metrics) failed: rc=$rc" | tee -a "$OUT/$name.log"
    tail -n 5 "$OUT/$name.log"
    [[ $rc -eq 124 ]] && return 1  # timed out: the core set would not be faster
  done
  [[ -s $OUT/$name.ncu-rep ]] || return 1
  "$NCU" -i "$OUT/$name.ncu-rep" --csv --page raw --print-units base > "$OUT/$name.csv" 2>> "$OUT/$name.log" \
    || "$NCU" -i "$OUT/$name.ncu-rep" --csv --page raw > "$OUT/$name.csv" 2>> "$OUT/$name.log"
}
