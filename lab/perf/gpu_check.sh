#!/usr/bin/env bash
# Build, check and time the fused kernel on a GPU machine in one go; logs under $OUT (or ./gpu-out).
#   lab/perf/gpu_check.sh [stages|tests|smoke|bench|gap|shared|warm|sample|all]...   (default: all)
# The kernel cache may be carried in ./.kcache (XDG_CACHE_HOME) to skip the nvcc build.
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$PWD/.kcache
steps=${*:-all}
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
summary=()
run() {  # run NAME CMD...: tee to $OUT/NAME.log, remember the exit code
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - t0)))")
  tail -n 40 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
run build python3 -c "
from trellis_cli.kernel.abi import default_library
try:
    lib = default_library()
except Exception as err:
    import shutil, os; shutil.rmtree(os.environ['XDG_CACHE_HOME'] + '/trellis', ignore_errors=True)
    print('carried build unusable, rebuilding:', str(err).splitlines()[0]); lib = default_library()
print('kernel', lib.build_hash, lib.arch, lib.path)"
if want stages; then
  run stages python3 lab/perf/kernel_stages.py
  [[ ${summary[-1]} == *"rc=0 "* ]] || { printf '%s\n' "${summary[@]}"; exit 1; }
fi
want tests && run tests python3 -m pytest -q -x tests/kernel/test_kernel_gpu.py tests/bench/test_bench_gpu.py \
  tests/bench/test_bench_mixed_gap.py
want smoke && run smoke python3 -m trellis_cli bench --synthetic glm52-tp4 --smoke
want bench && run bench bash -c "python3 -m trellis_cli bench --synthetic glm52-tp4 --json > $OUT/bench.json"
want bench && python3 lab/perf/bench_table.py "$OUT/bench.json" | tee "$OUT/bench_table.txt"
if want gap; then  # 192/64 beside uniform K3 and K4 layers of its shape, timed interleaved in one process
  run gap bash -c "python3 -m trellis_cli bench --synthetic glm52-tp4 --mixed-gap --json > $OUT/mixed_gap.json"
  python3 -c "import json, sys; from trellis_cli.cli.bench_gap import print_mixed_gap
doc = json.load(open(sys.argv[1])); print_mixed_gap(doc, doc['source'])" "$OUT/mixed_gap.json" \
    | tee "$OUT/mixed_gap_table.txt"
fi
if want shared; then  # the same layer with one suh/svh row for every expert (shared-H)
  run shared-smoke python3 -m trellis_cli bench --synthetic glm52-tp4-shared-h --smoke
  run shared-bench bash -c "python3 -m trellis_cli bench --synthetic glm52-tp4-shared-h --json > $OUT/bench_shared.json"
  python3 lab/perf/bench_table.py "$OUT/bench_shared.json" | tee "$OUT/bench_shared_table.txt"
fi
want warm && python3 -m trellis_cli bench --synthetic glm52-tp4 --warm --m 1,8,64 2>&1 | tee -a "$OUT/bench_table.txt"
if want sample; then  # the bundled sample: repacked on disk, and repacked in memory
  packed=$(mktemp -d)/routepack
  run sample bash -c "python3 -m trellis_cli repack trellis_cli/sample/tr3 $packed && \
    python3 -m trellis_cli bench $packed --m 1,8,64 && python3 -m trellis_cli bench $packed --smoke && \
    python3 -m trellis_cli bench trellis_cli/sample/tr3 --layer 4 --rank 1 --m 1,64"
fi
printf '%s\n' "${summary[@]}"
