#!/usr/bin/env bash
# Decoded-tile variants (lab/perf/decoded_variants.py) timed under sm_120's limits beside the compact 128-row
# kernels; each variant's outputs first compared bit for bit with its compact library, and only those that match
# are timed. Logs under $OUT (default ./decoded-variants-out), all in one tarball.
#   OUT=out lab/perf/decoded_variants.sh      (VARIANTS / ALL_VARIANTS: NAME=FC1,FC2,INTERLEAVED[,DECODERS]; MS;
#                                              ALL_VARIANTS empty: no all-K library)
set -u
OUT=${OUT:-./decoded-variants-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRELLIS_MMA_SYNC_ONLY=1
export TRELLIS_KERNEL_CACHE=${TRELLIS_KERNEL_CACHE:-$PWD/.kcache/trellis}
VARIANTS=${VARIANTS-both=1,1,1 fc1=1,0,1 fc2=0,1,1 fc2whole=0,1,0}
ALL_VARIANTS=${ALL_VARIANTS-allboth=1,1,1:all}
MS=${MS:-3072,8192}
failed=0
start=$(date +%s)
python3 lab/perf/decoded_variants.py k3k4 ${ALL_VARIANTS:+all} $VARIANTS $ALL_VARIANTS > "$OUT/libs.txt" 2> "$OUT/build.err" || failed=1
echo "built in $(( $(date +%s) - start )) s"; cat "$OUT/libs.txt"; tail -n 5 "$OUT/build.err"
lib() { awk -v n="$1" '$1 == n {print $2}' "$OUT/libs.txt"; }
export TRELLIS_PLAN_LIMITS=sm_120
same() {  # same BASE NAME: 0 when NAME's outputs are BASE's bit for bit (glm52-tp4: compare_libs.py)
  timeout 300 python3 lab/perf/compare_libs.py "$(lib "$1")" "$(lib "$2")" --m 512,1536,3072,8192 > "$OUT/same-$2.txt" 2>&1
  local rc=$?
  echo "bit-identical (glm52-tp4, $1 / $2): exit $rc, $(grep -c DIFFERENT "$OUT/same-$2.txt") differ of $(grep -c 'max |a - b|' "$OUT/same-$2.txt")"
  return $rc
}
k3k4=() all=()
for v in $VARIANTS; do same k3k4 "${v%%=*}" && k3k4+=("$(lib "${v%%=*}")") || failed=1; done
for v in $ALL_VARIANTS; do same all "${v%%=*}" && all+=("$(lib "${v%%=*}")") || failed=1; done
if [ ${#k3k4[@]} -gt 0 ]; then
  python3 lab/perf/perf_variants.py "$(lib k3k4)" "${k3k4[@]}" "$(lib k3k4)" "${k3k4[@]}" --m "$MS" --replays 50 \
    > "$OUT/time-k3k4.txt" 2>&1 || failed=1
fi
if [ ${#all[@]} -gt 0 ]; then
  python3 lab/perf/perf_variants.py "$(lib all)" "${all[@]}" "$(lib all)" "${all[@]}" --m "$MS" --replays 50 \
    --preset glm52-tp4-k3k5 > "$OUT/time-all.txt" 2>&1 || failed=1
fi
cat "$OUT"/time-*.txt 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT" --exclude=logs.tar.gz . 2>/dev/null
exit $failed
