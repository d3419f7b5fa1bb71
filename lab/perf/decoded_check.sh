#!/usr/bin/env bash
# Decoded tiles (lab/perf/decoded/) on a Hopper GPU under sm_120's limits: a copy of this tree with the decoded
# tiles (DECODED: FC1, FC2, interleaved, 0 or 1 each, then optionally decoder warps; lab/perf/decoded_variants.py)
# beside this tree as it is (its mma.sync-only build: the compact 128-row kernels) and the wgmma build. Logs and
# JSON under $OUT.
#   lab/perf/decoded_check.sh [same] [time] [tiles] [tests] [smoke] [sweep] [wgmma]...   (default: all)
# same: both mma.sync-only builds' outputs compared bit for bit (glm52-tp4, M = DIFF_MS). time: perf_variants of
# both, alternating (TIME_MS, both presets). tiles: the decoded build's fused time by forced m_tile (TILES at
# TILE_MS). tests, smoke, sweep: as lab/perf/sm120_limits.sh, on the decoded tree. wgmma: the wgmma build's sweep
# of this tree and the ratio per M.
set -u
OUT=${OUT:-./decoded-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$PWD
DEC=${DEC:-$ROOT/.decoded-tree}
CACHE=$ROOT/.kcache/base CACHE_DEC=$ROOT/.kcache/decoded
MS=${MS:-1,8,64,512,3072,8192}
DIFF_MS=${DIFF_MS:-512,1536,3072,8192}
TIME_MS=${TIME_MS:-512,3072,8192}
TILES=${TILES:-32,128}
TILE_MS=${TILE_MS:-512,1024}
PRESETS=${PRESETS:-glm52-tp4 glm52-tp4-k3k5}
DECODED=${DECODED:-1,1,1}  # FC1, FC2 on decoded tiles, the decode interleaved[, decoder warps] (decoded_variants.py)
SMOKE_PRESETS=${SMOKE_PRESETS:-glm52-tp4 glm52-tp4-shared-h glm52-tp4-k3k5}
steps=${*:-same time tiles tests smoke sweep wgmma}
want() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
failed=0
# the copy whose kernels/ has the decoded tiles (lab/perf/decoded_variants.py sources)
rm -rf "$DEC" && mkdir -p "$DEC"
tar --exclude=./.kcache --exclude=./.decoded-tree --exclude=./.git -cf - . | tar -xf - -C "$DEC"
rm -rf "$DEC/kernels" && (cd "$ROOT" && PYTHONPATH=$ROOT python3 lab/perf/decoded_variants.py sources "$DEC/kernels" "$DECODED") || exit 2
base() { (cd "$ROOT" && PYTHONPATH=$ROOT TRELLIS_MMA_SYNC_ONLY=1 TRELLIS_PLAN_LIMITS=sm_120 TRELLIS_KERNEL_CACHE=$CACHE "$@"); }
dec() { (cd "$DEC" && PYTHONPATH=$DEC TRELLIS_MMA_SYNC_ONLY=1 TRELLIS_PLAN_LIMITS=sm_120 TRELLIS_KERNEL_CACHE=$CACHE_DEC "$@"); }
wg() { (cd "$ROOT" && unset TRELLIS_MMA_SYNC_ONLY TRELLIS_PLAN_LIMITS && PYTHONPATH=$ROOT TRELLIS_KERNEL_CACHE=$CACHE "$@"); }
lib() { python3 -c "from trellis_cli.kernel.abi import default_library as d; print(d('mcg', kernels='$1', jobs=3).path)"; }
run() {  # run NAME CMD...: stdout to $OUT/NAME.out, stderr to .err, remember a failure
  local name=$1; shift
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err" || { echo "$name: exit $?"; failed=1; }
  tail -n 3 "$OUT/$name.err"
}
# the six libraries at once
start=$(date +%s)
base lib k3k4 > "$OUT/lib-base-k3k4" 2> "$OUT/build-base-k3k4.err" &
base lib all > "$OUT/lib-base-all" 2> "$OUT/build-base-all.err" &
dec lib k3k4 > "$OUT/lib-dec-k3k4" 2> "$OUT/build-dec-k3k4.err" &
dec lib all > "$OUT/lib-dec-all" 2> "$OUT/build-dec-all.err" &
wg lib k3k4 > "$OUT/lib-wg-k3k4" 2> "$OUT/build-wg-k3k4.err" &
wg lib all > "$OUT/lib-wg-all" 2> "$OUT/build-wg-all.err" &
wait
echo "built in $(( $(date +%s) - start )) s:"; for f in "$OUT"/lib-*; do echo "  $(basename "$f") $(cat "$f")"; done
for f in "$OUT"/build-*.err; do [ -s "$f" ] && { echo "$f:"; tail -n 5 "$f"; }; done
BK=$(cat "$OUT/lib-base-k3k4") BA=$(cat "$OUT/lib-base-all") DK=$(cat "$OUT/lib-dec-k3k4") DA=$(cat "$OUT/lib-dec-all")

if want same; then
  run same dec python3 lab/perf/compare_libs.py "$BK" "$DK" --m "$DIFF_MS"
  grep -c DIFFERENT "$OUT/same.out"; cat "$OUT/same.out"
fi
if want time; then
  run time-k3k4 dec python3 lab/perf/perf_variants.py "$BK" "$DK" "$BK" "$DK" --m "$TIME_MS" --replays 50
  run time-k3k5 dec python3 lab/perf/perf_variants.py "$BA" "$DA" "$BA" "$DA" --m "$TIME_MS" --replays 50 \
    --preset glm52-tp4-k3k5
  cat "$OUT/time-k3k4.out" "$OUT/time-k3k5.out"
fi
if want tiles; then
  run tiles dec python3 lab/perf/perf_variants.py "$BK" "$DK" --m "$TILE_MS" --mtile "$TILES" --replays 50
  cat "$OUT/tiles.out"
fi
if want tests; then
  run tests dec env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernel/test_kernel_portable_gpu.py \
    tests/kernel/test_kernel_determinism_gpu.py
  tail -n 3 "$OUT/tests.out"
fi
if want smoke; then
  for preset in $SMOKE_PRESETS; do
    run "smoke-$preset" dec python3 -m trellis_cli bench --synthetic "$preset" --smoke --json
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); k=d['environment']['kernel']; print('$preset', k['large_tiles'], k['plan_limits']['arch'], k['build_hash'])" "$OUT/smoke-$preset.out" || failed=1
  done
fi
if want sweep; then
  for preset in $PRESETS; do run "sweep-$preset" dec python3 -m trellis_cli bench --synthetic "$preset" --m "$MS" --json; done
fi
if want wgmma; then
  for preset in $PRESETS; do run "wgmma-$preset" wg python3 -m trellis_cli bench --synthetic "$preset" --m "$MS" --json; done
fi
if want sweep && want wgmma; then
  for preset in $PRESETS; do
    python3 - "$preset" "$OUT/sweep-$preset.out" "$OUT/wgmma-$preset.out" <<'PY' | tee "$OUT/ratio-$preset.txt" || failed=1
import json, sys
preset, portable, wgmma = sys.argv[1], *(json.load(open(p)) for p in sys.argv[2:])
rows = lambda doc: {r["m"]: r for r in doc["rows"]}
a, b = rows(portable), rows(wgmma)
print(f"{preset}: fused us (median), decoded tiles under sm_120 limits / wgmma build;",
      portable["environment"]["kernel"]["build_hash"], "/", wgmma["environment"]["kernel"]["build_hash"])
for m in sorted(a):
    pa, pb = a[m]["fused"]["median_us"], b[m]["fused"]["median_us"]
    print(f"  M={m:5d} {pa:9.1f} {pb:9.1f}  {pa / pb:5.2f}  {a[m]['plan']['family']} | {b[m]['plan']['family']}")
PY
  done
fi
tar -czf "$OUT/logs.tar.gz" -C "$OUT" --exclude=logs.tar.gz . 2>/dev/null
exit $failed
