#!/usr/bin/env bash
# The portable path proven on a Hopper GPU (issue 46): the mma.sync-only build (TRELLIS_MMA_SYNC_ONLY=1, no
# wgmma, as sm_80, sm_100 and sm_12x build) with every launch plan made for sm_120's limits
# (TRELLIS_PLAN_LIMITS=sm_120: 99 KB of shared memory per block, 16- and 32-row tiles), then the wgmma build
# of the same tree for the table beside it. Logs and JSON under $OUT (default ./sm120-out).
#   lab/perf/sm120_limits.sh [plan|tests|smoke|sweep|wgmma|all]...   (default: all; "plan" needs no GPU)
set -u
OUT=${OUT:-./sm120-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CACHE=${TRELLIS_KERNEL_CACHE:-$PWD/.kcache/trellis}
MS=${MS:-1,8,64,512,3072}
steps=${*:-all}
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
failed=0
portable() { TRELLIS_MMA_SYNC_ONLY=1 TRELLIS_PLAN_LIMITS=sm_120 TRELLIS_KERNEL_CACHE=$CACHE "$@"; }
run() {  # run NAME CMD...: stdout to $OUT/NAME.json or .log, stderr to $OUT/NAME.err, remember a failure
  local name=$1; shift
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err" || { echo "$name: exit $?"; failed=1; }
  tail -n 5 "$OUT/$name.err"
}
if want plan; then  # the plans the portable run will take: every M on 16- or 32-row tiles
  run plan portable python3 -m trellis_cli bench --plan --synthetic glm52-tp4 --m "$MS" --json
  python3 - "$OUT/plan.out" <<'PY' || failed=1
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["limits"]["arch"] == "sm_120" and doc["limits"]["source"] == "override", doc["limits"]
bad = [p for p in doc["plans"] if p["family"] not in ("mma16", "mma32")]
assert not bad, bad
print("plans under sm_120 limits:", [(p["m"], p["family"], p["k_split"]) for p in doc["plans"]])
PY
fi
if want tests; then  # small layers against float64, every M's plan on 16- or 32-row tiles
  TRELLIS_KERNEL_CACHE=$CACHE run tests python3 -m pytest -q -x tests/kernel/test_kernel_portable_gpu.py
fi
check_portable_env() {  # the JSON says it ran the mma.sync build under sm_120's limits
  python3 - "$1" <<'PY' || failed=1
import json, sys
kernel = json.load(open(sys.argv[1]))["environment"]["kernel"]
assert kernel["large_tiles"] == "mma.sync" and kernel["plan_limits"]["arch"] == "sm_120", kernel
print("ran:", kernel["arch"], kernel["large_tiles"], "plans for", kernel["plan_limits"]["arch"], kernel["build_hash"])
PY
}
if want smoke; then
  for preset in glm52-tp4 glm52-tp4-shared-h; do
    run "smoke-$preset" portable python3 -m trellis_cli bench --synthetic "$preset" --smoke --json
    check_portable_env "$OUT/smoke-$preset.out"
  done
fi
if want sweep; then
  run sweep portable python3 -m trellis_cli bench --synthetic glm52-tp4 --m "$MS" --json
  check_portable_env "$OUT/sweep.out"
  python3 lab/perf/bench_table.py "$OUT/sweep.out" | tee "$OUT/sweep_table.txt"
fi
if want wgmma; then  # the production build of the same tree, same M, for the comparison
  run sweep-wgmma env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS TRELLIS_KERNEL_CACHE=$CACHE \
    python3 -m trellis_cli bench --synthetic glm52-tp4 --m "$MS" --json
  python3 lab/perf/bench_table.py "$OUT/sweep-wgmma.out" | tee "$OUT/sweep_wgmma_table.txt"
fi
exit $failed
