"""Build libraries with the decoded tiles (kernels/decoded_mma.cuh) switched on, several at once, for
lab/perf/perf_variants.py: kDecodedFc1, kDecodedFc2 (kernels/gemm_tile.cuh, builds without wgmma) and
kDecodeInterleaved (decoded_mma.cuh) rewritten in a copy of kernels/ under the kernel cache.

    TRELLIS_MMA_SYNC_ONLY=1 python3 lab/perf/decoded_variants.py k3k4 both=1,1,1 fc2=0,1,1 whole=1,1,0:all

`k3k4` / `all`: the product library of that kernel set; NAME=FC1,FC2,INTERLEAVED[:all] (0 or 1 each): a variant of
the K3/K4 kernels (or, with `:all`, of the all-K kernels). Prints `NAME PATH` per library, in the order given.
"""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from trellis_cli.kernel import build

# the builds without wgmma: the two lines after #else
FLAGS_OFF = "#else\nconstexpr bool kDecodedFc1 = false;\nconstexpr bool kDecodedFc2 = false;\n"
INTERLEAVED = "constexpr bool kDecodeInterleaved = true;"


def variant_sources(name: str, fc1: bool, fc2: bool, interleaved: bool) -> Path:
    target = build.cache_dir() / "decoded-sources" / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(build.kernel_source_dir(), target)
    tile, mma = target / "gemm_tile.cuh", target / "decoded_mma.cuh"
    text = tile.read_text()
    if FLAGS_OFF not in text:
        raise SystemExit("kernels/gemm_tile.cuh: the decoded-tile flags not found")
    flags = f"#else\nconstexpr bool kDecodedFc1 = {str(fc1).lower()};\nconstexpr bool kDecodedFc2 = {str(fc2).lower()};\n"
    tile.write_text(text.replace(FLAGS_OFF, flags))
    text = mma.read_text()
    if INTERLEAVED not in text:
        raise SystemExit("kernels/decoded_mma.cuh: kDecodeInterleaved not found")
    mma.write_text(text.replace(INTERLEAVED, f"constexpr bool kDecodeInterleaved = {str(interleaved).lower()};"))
    return target


def build_one(spec: str) -> tuple[str, str]:
    if "=" not in spec:
        return spec, str(build.build_library("sm_90", codebook="mcg", kernels=spec, jobs=3).path)
    name, rest = spec.split("=", 1)
    values, _, kernels = rest.partition(":")
    bits = values.split(",")
    if len(bits) != 3 or any(b not in ("0", "1") for b in bits):
        raise SystemExit(f"{spec}: expected NAME=FC1,FC2,INTERLEAVED[:all], each 0 or 1")
    extension = build.BuildExtension(name, variant_sources(name, *(b == "1" for b in bits)))
    return name, str(build.build_library("sm_90", codebook="mcg", kernels=kernels or "k3k4", jobs=3,
                                         extension=extension).path)


def main() -> None:
    with ProcessPoolExecutor(max_workers=6) as pool:
        for name, path in pool.map(build_one, sys.argv[1:]):
            print(name, path, flush=True)


if __name__ == "__main__":
    main()
