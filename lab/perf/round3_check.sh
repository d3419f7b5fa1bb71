#!/usr/bin/env bash
# One device call of the third large-M round: both builds of this tree beside BASE's kernels (a directory
# holding an earlier kernels/), their SASS compared, then the steps named: "tail" (FC1's tail x4 against whole
# ranges under sm_120's limits, alternating), "sweep" (lab/perf/sm120_limits.sh sweep wgmma), "tests", "smoke".
set -u
OUT=${OUT:-./round3-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRELLIS_KERNEL_CACHE=${TRELLIS_KERNEL_CACHE:-$PWD/.kcache/trellis}
steps=" $* "
P="env TRELLIS_MMA_SYNC_ONLY=1 TRELLIS_PLAN_LIMITS=sm_120"
W="env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS"
base() {  # the library of BASE's kernels, kernel set $1 (under the environment of the caller)
  python3 -c "import sys; from pathlib import Path; from trellis_cli.kernel import build as b
print(b.build_library(codebook='mcg', kernels=sys.argv[1], jobs=4,
      extension=b.BuildExtension('base', Path(sys.argv[2]))).path)" "$1" "$BASE"
}
t0=$SECONDS
{ $W python3 lab/perf/staging_variants.py k3k4 all > "$OUT/libs-wgmma.txt"; } 2> "$OUT/build-w.err" &
{ $P python3 lab/perf/staging_variants.py k3k4 all > "$OUT/libs-portable.txt"; } 2> "$OUT/build-p.err" &
if [ -n "${BASE:-}" ]; then
  { for k in k3k4 all; do echo "$k $(unset TRELLIS_MMA_SYNC_ONLY TRELLIS_PLAN_LIMITS; base $k)"; done > "$OUT/base-wgmma.txt"; } 2> "$OUT/build-bw.err" &
  { for k in k3k4 all; do echo "$k $(export TRELLIS_MMA_SYNC_ONLY=1; base $k)"; done > "$OUT/base-portable.txt"; } 2> "$OUT/build-bp.err" &
fi
wait
echo "builds: $((SECONDS - t0)) s"
lib() { awk -v n="$2" '$1 == n {print $2}' "$OUT/$1.txt"; }
if [ -n "${BASE:-}" ]; then
  for b in wgmma portable; do for k in k3k4 all; do
    echo "SASS $b $k: $(python3 lab/perf/sass_same.py "$(lib base-$b $k)" "$(lib libs-$b $k)" | head -n 5)"
  done; done
fi
if [[ $steps == *" sweep "* ]]; then
  OUT=$OUT MS=1,8,64,512,3072,8192 lab/perf/sm120_limits.sh sweep wgmma > "$OUT/sweep.log" 2>&1
  echo "sweep: $((SECONDS - t0)) s"
fi
if [[ $steps == *" tail "* ]]; then
  $P python3 lab/perf/perf_variants.py "$(lib libs-portable k3k4)" --preset glm52-tp4 --m 64,512,1024 \
    --replays 50 --tail 4,1,4,1 > "$OUT/tail-k3k4.txt" 2>&1
  $P python3 lab/perf/perf_variants.py "$(lib libs-portable all)" --preset glm52-tp4-k3k5 --m 64,512 \
    --replays 50 --tail 4,1,4,1 > "$OUT/tail-all.txt" 2>&1
  echo "tail: $((SECONDS - t0)) s"
fi
if [[ $steps == *" smoke "* ]]; then
  OUT=$OUT SMOKE_PRESETS="glm52-tp4 glm52-tp4-k3k5 glm52-tp4-shared-h" lab/perf/sm120_limits.sh smoke > "$OUT/smoke.log" 2>&1
  grep -h "checks\|passed\|failed\|ran:" "$OUT/smoke.log" | tail -n 8; echo "smoke: $((SECONDS - t0)) s"
fi
if [[ $steps == *" tests "* ]]; then
  timeout $(( ${BUDGET:-560} - (SECONDS - t0) )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernel/test_kernel_portable_gpu.py \
    tests/kernel/test_kernel_determinism_gpu.py > "$OUT/tests.txt" 2>&1
  tail -n 3 "$OUT/tests.txt"; echo "tests: $((SECONDS - t0)) s"
fi
for f in tail-k3k4 tail-all mtile-k3k4; do [ -f "$OUT/$f.txt" ] && { echo "== $f"; grep -v "^graph" "$OUT/$f.txt"; }; done
[ -f "$OUT/sweep.log" ] && cat "$OUT"/ratio-*.txt
exit 0
