#!/usr/bin/env bash
# The compact 128-row kernels' ring variants (lab/perf/staging_variants.py) timed side by side under sm_120's
# limits, the wgmma build beside them, M=512's tile and split choices, and the phases of both lab builds.
# Logs under $OUT. VARIANTS / ALL_VARIANTS: the variant specs of the K3/K4 and the all-K kernels.
set -u
OUT=${OUT:-./staging-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRELLIS_KERNEL_CACHE=${TRELLIS_KERNEL_CACHE:-$PWD/.kcache/trellis}
MS=${MS:-512,3072,8192}
REPLAYS=${REPLAYS:-50}
VARIANTS=${VARIANTS:-s2482=2,4,8,2 s2382=2,3,8,2 s4244=4,2,4,4 s2444=2,4,4,4}
ALL_VARIANTS=${ALL_VARIANTS:-a2343=2,3,4,3:all a2225=2,2,2,5:all}
P="env TRELLIS_MMA_SYNC_ONLY=1 TRELLIS_PLAN_LIMITS=sm_120"
W="env -u TRELLIS_MMA_SYNC_ONLY -u TRELLIS_PLAN_LIMITS"
t0=$SECONDS
$W python3 lab/perf/staging_variants.py k3k4 all > "$OUT/libs-wgmma.txt" 2> "$OUT/build-wgmma.err" &
$W python3 -c "from lab.kernel import lab; print(lab.lab_library('mcg').path)" > "$OUT/lab-wgmma.txt" 2>&1 &
$P python3 -c "from lab.kernel import lab; print(lab.lab_library('mcg').path)" > "$OUT/lab-portable.txt" 2>&1 &
$P python3 lab/perf/staging_variants.py k3k4 all $VARIANTS $ALL_VARIANTS > "$OUT/libs-portable.txt" 2> "$OUT/build-portable.err"
wait
echo "builds: $((SECONDS - t0)) s"; cat "$OUT/libs-wgmma.txt" "$OUT/libs-portable.txt"; tail -3 "$OUT"/build-*.err
lib() { awk -v n="$2" '$1 == n {print $2}' "$OUT/libs-$1.txt"; }
for v in $(lib portable k3k4) $(for s in $VARIANTS; do lib portable "${s%%=*}"; done); do
  cuobjdump -res-usage "$v" 2>/dev/null | grep -A1 "fc[12]_kernelILi1ELi8E" | grep -o "REG:[0-9]* STACK:[0-9]*" | tr '\n' ' '
  echo " $(basename "$v")"
done > "$OUT/res.txt"
cat "$OUT/res.txt"
k3k4_libs="$(lib portable k3k4) $(for s in $VARIANTS; do lib portable "${s%%=*}"; done) $(lib portable k3k4)"
all_libs="$(lib portable all) $(for s in $ALL_VARIANTS; do lib portable "${s%%=*}"; done) $(lib portable all)"
$P python3 lab/perf/perf_variants.py $k3k4_libs --preset glm52-tp4 --m "$MS" --replays "$REPLAYS" > "$OUT/var-k3k4.txt" 2>&1
$P python3 lab/perf/perf_variants.py $all_libs --preset glm52-tp4-k3k5 --m "$MS" --replays "$REPLAYS" > "$OUT/var-all.txt" 2>&1
$W python3 lab/perf/perf_variants.py $(lib wgmma k3k4) --preset glm52-tp4 --m "$MS" --replays "$REPLAYS" > "$OUT/wg-k3k4.txt" 2>&1
$W python3 lab/perf/perf_variants.py $(lib wgmma all) --preset glm52-tp4-k3k5 --m "$MS" --replays "$REPLAYS" > "$OUT/wg-all.txt" 2>&1
echo "timed: $((SECONDS - t0)) s"
$P python3 lab/perf/perf_variants.py $(lib portable k3k4) --preset glm52-tp4 --m 512 --replays "$REPLAYS" \
  --mtile 16,32,128 --split 1,2 --tail 1,2,4 > "$OUT/m512.txt" 2>&1
$P python3 lab/perf/perf_variants.py --phases --preset glm52-tp4 --m 512,3072 --replays 30 > "$OUT/phases-portable.txt" 2>&1
$W python3 lab/perf/perf_variants.py --phases --preset glm52-tp4 --m 512,3072 --replays 30 > "$OUT/phases-wgmma.txt" 2>&1
echo "all: $((SECONDS - t0)) s"
for f in var-k3k4 var-all wg-k3k4 wg-all m512 phases-portable phases-wgmma; do echo "== $f"; grep -v "^graph" "$OUT/$f.txt" | tail -n 24; done
