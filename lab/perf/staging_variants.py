"""Build libraries of this tree side by side, several at once: the product library and variants of the compact
128-row kernels' ring (k tiles per staged chunk and stages of FC1 and FC2, kernels/gemm_tile.cuh
compact_staging, set by build defines), for lab/perf/perf_variants.py.

    TRELLIS_MMA_SYNC_ONLY=1 python3 lab/perf/staging_variants.py k3k4 all s2482=2,4,8,2 a2343=2,3,4,3:all

`k3k4` / `all`: the product library of that kernel set; NAME=FC1_KT,FC1_STAGES,FC2_KT,FC2_STAGES[:all]: a variant
of the K3/K4 kernels (or, with `:all`, of the all-K kernels). Prints `NAME PATH` per library, in the order given.
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor

from trellis_cli.kernel import build

MACROS = ("FC1_KT", "FC1_ST", "FC2_KT", "FC2_ST")


def build_one(spec: str) -> tuple[str, str]:
    if "=" not in spec:
        return spec, str(build.build_library(codebook="mcg", kernels=spec, jobs=4).path)
    name, rest = spec.split("=", 1)
    values, _, kernels = rest.partition(":")
    kset = "ALL" if kernels == "all" else "FAST"
    defines = tuple(f"-DTRELLIS_CS_{kset}_{m}={v}" for m, v in zip(MACROS, values.split(","), strict=True))
    extension = build.BuildExtension(name, build.kernel_source_dir(), defines)
    return name, str(build.build_library(codebook="mcg", kernels=kernels or "k3k4", jobs=4, extension=extension).path)


def main() -> None:
    with ProcessPoolExecutor(max_workers=4) as pool:
        for name, path in pool.map(build_one, sys.argv[1:]):
            print(name, path, flush=True)


if __name__ == "__main__":
    main()
