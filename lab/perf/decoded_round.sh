#!/usr/bin/env bash
# One device call: the decoded-tile variants timed (lab/perf/decoded_variants.sh, at VARIANT_MS); where one beats
# the compact kernels at every M on glm52-tp4 (both repeats), lab/perf/decoded_check.sh on a tree with it
# (CHECK_STEPS: tests, smoke, sweep beside the wgmma build), else (SWEEP=1, the default) the plain sweeps of both
# builds for the record.
set -u
OUT=${OUT:-./decoded-round-out}
mkdir -p "$OUT/variants" "$OUT/check"
MS=${VARIANT_MS:-3072,8192} OUT=$OUT/variants lab/perf/decoded_variants.sh
best=$(python3 - "$OUT/variants/time-k3k4.txt" "$OUT/variants/libs.txt" <<'PY'
import sys
from collections import defaultdict
names = {path.split("/")[-1].removesuffix(".so"): name for name, path in (l.split() for l in open(sys.argv[2]))}
times = defaultdict(list)  # (variant, M) -> fused us
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 3 and f[0] in names and f[1].isdigit():
        times[(names[f[0]], int(f[1]))].append(float(f[2]))
ms = sorted({m for _, m in times})
base = {m: min(times[("k3k4", m)]) for m in ms}
wins = {}
for (v, m), t in times.items():
    if v != "k3k4":
        wins.setdefault(v, []).append(max(t) < base[m])
good = [v for v, w in wins.items() if all(w)]
print(min(good, key=lambda v: sum(min(times[(v, m)]) for m in ms)) if good else "")
PY
)
echo "faster than the compact kernels at every M: ${best:-none}"
flags=$(echo "${VARIANTS:-both=1,1,1 fc1=1,0,1 fc2=0,1,1 fc2whole=0,1,0}" | tr ' ' '\n' | awk -F= -v b="$best" '$1 == b {print $2}')
if [ -n "$best" ]; then
  OUT=$OUT/check DECODED=$flags lab/perf/decoded_check.sh ${CHECK_STEPS:-same tests smoke sweep wgmma}
elif [ "${SWEEP:-1}" = 1 ]; then  # the product's ratio per M in the same call (its portable libraries are cached)
  OUT=$OUT/check lab/perf/sm120_limits.sh sweep wgmma
fi
