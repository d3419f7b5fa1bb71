"""Build libraries of this tree side by side, several at once: the product library and variants of the compact
128-row kernels' ring (k tiles per staged chunk and stages of FC1 and FC2: kernels/gemm_tile.cuh
compact_staging, rewritten in a copy of kernels/ under the kernel cache), for lab/perf/perf_variants.py.

    TRELLIS_MMA_SYNC_ONLY=1 python3 lab/perf/staging_variants.py k3k4 all s2482=2,4,8,2 a2343=2,3,4,3:all

`k3k4` / `all`: the product library of that kernel set; NAME=FC1_KT,FC1_STAGES,FC2_KT,FC2_STAGES[:all]: a variant
of the K3/K4 kernels (or, with `:all`, of the all-K kernels). Prints `NAME PATH` per library, in the order given.
"""

from __future__ import annotations

import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from trellis_cli.kernel import build

# compact_staging's one line: {FC1 k tiles, FC1 stages, FC2 k tiles, FC2 stages} of the K3/K4 : the all-K kernels
STAGING = re.compile(r"return fast \? CompactStaging\{([^}]*)\} : CompactStaging\{([^}]*)\};")


def variant_sources(name: str, values: str, all_k: bool) -> Path:
    """A copy of kernels/ whose compact_staging returns `values` for the K3/K4 (or the all-K) kernels."""
    target = build.cache_dir() / "staging-sources" / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(build.kernel_source_dir(), target)
    header = target / "gemm_tile.cuh"
    text = header.read_text()
    found = STAGING.search(text)
    if not found:
        raise SystemExit("kernels/gemm_tile.cuh: compact_staging's line not found")
    fast, every = found.group(1), found.group(2)
    new = values.replace(",", ", ")
    line = f"return fast ? CompactStaging{{{fast if all_k else new}}} : CompactStaging{{{new if all_k else every}}};"
    header.write_text(text[:found.start()] + line + text[found.end():])
    return target


def build_one(spec: str) -> tuple[str, str]:
    if "=" not in spec:
        return spec, str(build.build_library("sm_90", codebook="mcg", kernels=spec, jobs=4).path)
    name, rest = spec.split("=", 1)
    values, _, kernels = rest.partition(":")
    if len(values.split(",")) != 4:
        raise SystemExit(f"{spec}: expected NAME=FC1_KT,FC1_STAGES,FC2_KT,FC2_STAGES[:all]")
    extension = build.BuildExtension(name, variant_sources(name, values, kernels == "all"))
    return name, str(build.build_library("sm_90", codebook="mcg", kernels=kernels or "k3k4", jobs=4,
                                         extension=extension).path)


def main() -> None:
    with ProcessPoolExecutor(max_workers=4) as pool:
        for name, path in pool.map(build_one, sys.argv[1:]):
            print(name, path, flush=True)


if __name__ == "__main__":
    main()
