#!/usr/bin/env bash
# The portable path proven on a Hopper GPU (issue 46): the mma.sync-only build (TRELLIS_MMA_SYNC_ONLY=1, no
# wgmma, as sm_80, sm_100 and sm_12x build) with every launch plan made for sm_120's limits
# (TRELLIS_PLAN_LIMITS=sm_120: 99 KB of shared memory per block, 16- and 32-row tiles), then the wgmma build
# of the same tree for the table beside it. Logs and JSON under $OUT (default ./sm120-out).
#   lab/perf/sm120_limits.sh [plan|tests|smoke|sweep|wgmma|tiles|identity|all]...   (default: all but tiles and
#   identity; "plan" needs no GPU)
# SMOKE_PRESETS / SWEEP_PRESETS: the presets of --smoke and of the sweeps (the K3/K4 layer, its shared-H twin,
# the K3/K5 layer on the all-K kernels). tiles: the portable build's fused time by forced m_tile (TILES, at
# TILE_MS) beside its plan. identity: the wgmma build of BASE (a directory holding an earlier tree) against this
# tree's, outputs compared bit for bit and timed side by side (lab/perf/compare_libs.py, perf_variants.py).
set -u
OUT=${OUT:-./sm120-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CACHE=${TRELLIS_KERNEL_CACHE:-$PWD/.kcache/trellis}
MS=${MS:-1,8,64,512,3072,8192}
SMOKE_PRESETS=${SMOKE_PRESETS:-glm52-tp4 glm52-tp4-shared-h glm52-tp4-k3k5}
SWEEP_PRESETS=${SWEEP_PRESETS:-glm52-tp4 glm52-tp4-k3k5}
TILES=${TILES:-32,128}
TILE_MS=${TILE_MS:-512,768,1024,1536,2048}
steps=${*:-all}
named() { [[ " $steps " == *" $1 "* ]]; }
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
failed=0
portable() { TRELLIS_MMA_SYNC_ONLY=1 TRELLIS_PLAN_LIMITS=sm_120 TRELLIS_KERNEL_CACHE=$CACHE "$@"; }
run() {  # run NAME CMD...: stdout to $OUT/NAME.json or .log, stderr to $OUT/NAME.err, remember a failure
  local name=$1; shift
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err" || { echo "$name: exit $?"; failed=1; }
  tail -n 5 "$OUT/$name.err"
}
if want plan; then  # the plans the portable run will take: every M on mma.sync tiles
  for preset in $SWEEP_PRESETS; do
    run "plan-$preset" portable python3 -m trellis_cli bench --plan --synthetic "$preset" --m "$MS" --json
    python3 - "$OUT/plan-$preset.out" <<'PY' || failed=1
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["limits"]["arch"] == "sm_120" and doc["limits"]["source"] == "override", doc["limits"]
bad = [p for p in doc["plans"] if p["family"] not in ("mma16", "mma32", "mma128")]
assert not bad, bad
print("plans under sm_120 limits:", [(p["m"], p["family"], p["k_split"]) for p in doc["plans"]])
PY
  done
fi
if want tests; then  # small layers against float64 on every tile family and K 2..6; repeats on skewed routes
  TRELLIS_KERNEL_CACHE=$CACHE run tests python3 -m pytest -q -m gpu tests/kernel/test_kernel_portable_gpu.py \
    tests/kernel/test_kernel_determinism_gpu.py
  tail -n 3 "$OUT/tests.out"
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
  for preset in $SMOKE_PRESETS; do
    run "smoke-$preset" portable python3 -m trellis_cli bench --synthetic "$preset" --smoke --json
    check_portable_env "$OUT/smoke-$preset.out"
  done
fi
if want sweep; then
  for preset in $SWEEP_PRESETS; do
    run "sweep-$preset" portable python3 -m trellis_cli bench --synthetic "$preset" --m "$MS" --json
    check_portable_env "$OUT/sweep-$preset.out"
    python3 lab/perf/bench_table.py "$OUT/sweep-$preset.out" > "$OUT/sweep-$preset.txt"
  done
fi
if want wgmma; then  # the production build of the same tree, same M, for the comparison
  for preset in $SWEEP_PRESETS; do
    run "wgmma-$preset" env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS TRELLIS_KERNEL_CACHE=$CACHE \
      python3 -m trellis_cli bench --synthetic "$preset" --m "$MS" --json
    python3 lab/perf/bench_table.py "$OUT/wgmma-$preset.out" > "$OUT/wgmma-$preset.txt"
  done
fi
if want sweep && want wgmma; then  # the ratio per M, both builds of this run
  for preset in $SWEEP_PRESETS; do
    python3 - "$preset" "$OUT/sweep-$preset.out" "$OUT/wgmma-$preset.out" <<'PY' | tee "$OUT/ratio-$preset.txt" || failed=1
import json, sys
preset, portable, wgmma = sys.argv[1], *(json.load(open(p)) for p in sys.argv[2:])
def rows(doc):
    return {r["m"]: r for r in doc["rows"]}
a, b = rows(portable), rows(wgmma)
print(f"{preset}: fused us (median), portable under sm_120 limits / wgmma build")
for m in sorted(a):
    pa, pb = a[m]["fused"]["median_us"], b[m]["fused"]["median_us"]
    print(f"  M={m:5d} {pa:9.1f} {pb:9.1f}  {pa / pb:5.2f}  {a[m]['plan']['family']} | {b[m]['plan']['family']}")
PY
  done
fi
if named tiles; then  # the portable build's fused time by forced m_tile (the device's own limits: a timing only)
  lib=$(portable python3 -c "from trellis_cli.kernel.abi import default_library as d; print(d('mcg', kernels='k3k4').path)")
  run tiles portable python3 lab/perf/perf_variants.py "$lib" --m "$TILE_MS" --mtile "$TILES"
  cat "$OUT/tiles.out"
fi
if named identity; then  # BASE's wgmma build against this tree's: bit-identical outputs, times side by side
  base_lib=$(cd "$BASE" && env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS PYTHONPATH="$BASE" \
    TRELLIS_KERNEL_CACHE=$CACHE-base python3 -c \
    "from trellis_cli.kernel.build import build_library as b; print(b(codebook='mcg', kernels='k3k4').path)")
  lib=$(env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS TRELLIS_KERNEL_CACHE=$CACHE python3 -c \
    "from trellis_cli.kernel.build import build_library as b; print(b(codebook='mcg', kernels='k3k4').path)")
  run identity env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS python3 lab/perf/compare_libs.py "$base_lib" "$lib" \
    --m "1,3,8,64,512,3072,8192"
  run identity-time env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS python3 lab/perf/perf_variants.py \
    "$base_lib" "$lib" "$base_lib" "$lib" --m "$MS"
  grep -c DIFFERENT "$OUT/identity.out"; cat "$OUT/identity-time.out"
fi
exit $failed
