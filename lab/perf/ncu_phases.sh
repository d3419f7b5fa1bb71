#!/usr/bin/env bash
# Profile FC1 and FC2 of the second eager call at production shape with ncu (clocks left alone):
#   lab/perf/ncu_phases.sh M [LIB.so]           -> stall reasons, pipe use, occupancy, issue rate per kernel
#   lab/perf/ncu_phases.sh --pipes M [LIB.so]   -> the per-pipe metrics of lab/perf/pipe_facts.py (the
#       pipe-facts table's columns) into $OUT/ncu_pipes_m<M>.{ncu-rep,csv,log,md} (OUT default ./out)
set -u
pipes=0
[[ ${1:-} == --pipes ]] && { pipes=1; shift; }
m=${1:?M}; lib=${2:-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XDG_CACHE_HOME=$PWD/.kcache
phases=(--kernel-name regex:'fc1_|fc2_' --launch-skip 2 --launch-count 2)
if [[ $pipes == 1 ]]; then
  OUT=${OUT:-./out}
  mkdir -p "$OUT"
  . lab/perf/ncu_pipes.sh
  name=ncu_pipes_m$m
  ncu_pipes "$name" "${phases[@]}" -- python3 lab/perf/profile_once.py "$m" $lib || exit 1
  python3 lab/perf/pipe_facts.py table "$OUT/$name.csv" | tee "$OUT/$name.md"
  exit "${PIPESTATUS[0]}"
fi
ncu --clock-control none "${phases[@]}" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:sm__pipe_tensor_op_.*cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct' \
  python3 lab/perf/profile_once.py "$m" $lib
