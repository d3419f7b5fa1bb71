"""Build libraries with the decoded tiles (lab/perf/decoded/) in place of the compact 128-row FC1 and FC2 of a
build without wgmma, several at once, for lab/perf/perf_variants.py; or write such a copy of kernels/ (`sources`).

    TRELLIS_MMA_SYNC_ONLY=1 python3 lab/perf/decoded_variants.py k3k4 both=1,1,1 fc2=0,1,1 whole=1,1,0:all
    python3 lab/perf/decoded_variants.py sources DIR 1,1,1

`k3k4` / `all`: the product library of that kernel set; NAME=FC1,FC2,INTERLEAVED[:all] (0 or 1 each): a variant of
the K3/K4 kernels (or, with `:all`, of the all-K kernels): a copy of kernels/ with decoded_mma.cuh added,
fc1_decoded.inc and fc2_decoded.inc inserted before fc1_kernel and fc2_kernel, their dispatch and shared memory
switched by kDecodedFc1 and kDecodedFc2 (false in the wgmma build), and kDecodeInterleaved set. Prints
`NAME PATH` per library, in the order given. The product's kernels/ holds none of this.
"""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from trellis_cli.kernel import build

LAB = Path(__file__).resolve().parent / "decoded"
INTERLEAVED = "constexpr bool kDecodeInterleaved = true;"
# (file, text found once, its replacement); {fc1} {fc2}: the flags' values, {fc1_body} {fc2_body}: the .inc files
EDITS = (
    ("gemm_tile.cuh", "__host__ __device__ constexpr int fc1_chunk_tiles(int r, bool fast) {",
     "#ifdef TRELLIS_WGMMA\nconstexpr bool kDecodedFc1 = false, kDecodedFc2 = false;\n#else\n"
     "constexpr bool kDecodedFc1 = {fc1}, kDecodedFc2 = {fc2};\n#endif\n"
     "__host__ __device__ constexpr int fc1_chunk_tiles(int r, bool fast) {"),
    ("fc1.cuh", '#include "copy_pipeline.cuh"\n', '#include "copy_pipeline.cuh"\n#include "decoded_mma.cuh"\n'),
    ("fc1.cuh", "template <int CB, int R, bool FAST>\n__global__ void __launch_bounds__(kFc1Threads",
     "{fc1_body}\ntemplate <int CB, int R, bool FAST>\n__global__ void __launch_bounds__(kFc1Threads"),
    ("fc1.cuh", "    fc1_body<CB, R, decltype(k)::value, FAST>(a, w, piece.item % nchunks, piece.kc0, piece.chunks, piece.plane,\n"
                "                                              gemm_smem);\n",
     "    if constexpr (kDecodedFc1 && !small_tile(R))\n"
     "      fc1_decoded_body<CB, decltype(k)::value, FAST>(a, w, piece.item % nchunks, piece.kc0, piece.chunks,\n"
     "                                                     piece.plane, gemm_smem);\n"
     "    else\n"
     "      fc1_body<CB, R, decltype(k)::value, FAST>(a, w, piece.item % nchunks, piece.kc0, piece.chunks, piece.plane,\n"
     "                                                gemm_smem);\n"),
    ("fc1.cuh", "__host__ __device__ constexpr int fc1_smem_bytes(int r, bool fast) {\n  return ",
     "__host__ __device__ constexpr int fc1_smem_bytes(int r, bool fast) {\n"
     "  return kDecodedFc1 && r > 2 ? decoded_fc1_smem_bytes(fast) :\n         "),
    ("fc2.cuh", '#include "copy_pipeline.cuh"\n', '#include "copy_pipeline.cuh"\n#include "decoded_mma.cuh"\n'),
    ("fc2.cuh", "// Grid (tiles, groups): blockIdx.x is the tile", "{fc2_body}\n// Grid (tiles, groups): blockIdx.x is the tile"),
    ("fc2.cuh", "  with_k<FAST>(w.k, [&](auto k) { fc2_body<CB, R, decltype(k)::value, FAST>(a, w, blockIdx.y * span, span, gemm_smem); });",
     "  with_k<FAST>(w.k, [&](auto k) {\n"
     "    if constexpr (kDecodedFc2 && !small_tile(R)) fc2_decoded_body<CB, decltype(k)::value, FAST>(a, w, blockIdx.y, gemm_smem);\n"
     "    else fc2_body<CB, R, decltype(k)::value, FAST>(a, w, blockIdx.y * span, span, gemm_smem);\n"
     "  });"),
    ("fc2.cuh", "__host__ __device__ constexpr int fc2_smem_bytes(int r, bool fast) {\n  return ",
     "__host__ __device__ constexpr int fc2_smem_bytes(int r, bool fast) {\n"
     "  return kDecodedFc2 && r > 2 ? decoded_fc2_smem_bytes(fast) :\n         "),
)


def write_sources(target: Path, fc1: bool, fc2: bool, interleaved: bool) -> Path:
    """A copy of kernels/ at `target` with the decoded tiles added and switched as asked."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(build.kernel_source_dir(), target)
    mma = (LAB / "decoded_mma.cuh").read_text()
    if INTERLEAVED not in mma:
        raise SystemExit("decoded_mma.cuh: kDecodeInterleaved not found")
    (target / "decoded_mma.cuh").write_text(mma.replace(INTERLEAVED, f"constexpr bool kDecodeInterleaved = {str(interleaved).lower()};"))
    values = {"fc1": str(fc1).lower(), "fc2": str(fc2).lower(),
              "fc1_body": (LAB / "fc1_decoded.inc").read_text(), "fc2_body": (LAB / "fc2_decoded.inc").read_text()}
    for name, old, new in EDITS:
        path = target / name
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"kernels/{name}: the text to patch is not there once: {old[:60]!r}")
        for key, value in values.items():
            new = new.replace("{" + key + "}", value)
        path.write_text(text.replace(old, new))
    return target


def variant_sources(name: str, fc1: bool, fc2: bool, interleaved: bool) -> Path:
    return write_sources(build.cache_dir() / "decoded-sources" / name, fc1, fc2, interleaved)


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
    if sys.argv[1:2] == ["sources"]:  # sources DIR FC1,FC2,INTERLEAVED
        bits = sys.argv[3].split(",")
        write_sources(Path(sys.argv[2]), *(b == "1" for b in bits))
        return
    with ProcessPoolExecutor(max_workers=6) as pool:
        for name, path in pool.map(build_one, sys.argv[1:]):
            print(name, path, flush=True)


if __name__ == "__main__":
    main()
