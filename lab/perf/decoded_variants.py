"""Build libraries with the decoded tiles (lab/perf/decoded/) in place of the compact 128-row FC1 and FC2 of a
build without wgmma, several at once, for lab/perf/perf_variants.py; or write such a copy of kernels/ (`sources`).

    TRELLIS_MMA_SYNC_ONLY=1 python3 lab/perf/decoded_variants.py k3k4 both=1,1,1 fc2=0,1,1 whole=1,1,0:all ws4=1,0,0,4
    python3 lab/perf/decoded_variants.py sources DIR 1,1,1[,DECODERS]

`k3k4` / `all`: the product library of that kernel set; NAME=FC1,FC2,INTERLEAVED[,DECODERS][:all] (0 or 1 each,
DECODERS a count of warps): a variant of the K3/K4 kernels (or, with `:all`, of the all-K kernels): a copy of
kernels/ with decoded_mma.cuh added, fc1_decoded.inc (with fc1_ws.inc) and fc2_decoded.inc inserted before
fc1_kernel and fc2_kernel, their dispatch and shared memory switched by kDecodedFc1 and kDecodedFc2 (false in the
wgmma build), and kDecodeInterleaved set. DECODERS > 0 (with FC1 = 1): the warp-specialized FC1 (fc1_ws.inc), its
128-row kernel launched with that many decoder warps beside the 16 multiplying ones (fc1_threads). Prints
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
     "#ifdef TRELLIS_WGMMA\nconstexpr int kWsDecoders = 0;\n#else\nconstexpr int kWsDecoders = {ws};\n#endif\n"
     "__host__ __device__ constexpr int fc1_chunk_tiles(int r, bool fast) {"),
    ("fc1.cuh", '#include "copy_pipeline.cuh"\n', '#include "copy_pipeline.cuh"\n#include "decoded_mma.cuh"\n'),
    ("fc1.cuh", "template <int CB, int R, bool FAST>\n__global__ void __launch_bounds__(kFc1Threads",
     "{fc1_body}\ntemplate <int CB, int R, bool FAST>\n__global__ void __launch_bounds__(kFc1Threads"),
    # the warp-specialized FC1 launches 16 + kWsDecoders warps for its 128-row kernel (kFc1Threads elsewhere)
    ("gemm_tile.cuh", "constexpr int kFc2Threads = 256;",
     "__host__ __device__ constexpr int fc1_threads(int r) {\n"
     "  return kDecodedFc1 && kWsDecoders > 0 && r > 2 ? kFc1Threads + 32 * kWsDecoders : kFc1Threads;\n}\n"
     "constexpr int kFc2Threads = 256;"),
    ("fc1.cuh", "__launch_bounds__(kFc1Threads, (small_tile(R) && FAST) ? 2 : 1)",
     "__launch_bounds__(fc1_threads(R), (small_tile(R) && FAST) ? 2 : 1)"),
    ("gemm_unit.cu", "kFc1Threads, fc1_smem_bytes(R, FAST)", "fc1_threads(R), fc1_smem_bytes(R, FAST)"),
    ("fc1.cuh", "    fc1_body<CB, R, decltype(k)::value, FAST>(a, w, piece.item % nchunks, piece.kc0, piece.chunks, piece.plane,\n"
                "                                              gemm_smem);\n",
     "    if constexpr (kDecodedFc1 && kWsDecoders > 0 && !small_tile(R))\n"
     "      fc1_ws_body<CB, decltype(k)::value, FAST>(a, w, piece.item % nchunks, piece.kc0, piece.chunks, piece.plane,\n"
     "                                                gemm_smem);\n"
     "    else if constexpr (kDecodedFc1 && !small_tile(R))\n"
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


def write_sources(target: Path, fc1: bool, fc2: bool, interleaved: bool, decoders: int = 0) -> Path:
    """A copy of kernels/ at `target` with the decoded tiles added and switched as asked (decoders > 0: FC1's
    warp-specialized form with that many decoder warps)."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(build.kernel_source_dir(), target)
    mma = (LAB / "decoded_mma.cuh").read_text()
    if INTERLEAVED not in mma:
        raise SystemExit("decoded_mma.cuh: kDecodeInterleaved not found")
    (target / "decoded_mma.cuh").write_text(mma.replace(INTERLEAVED, f"constexpr bool kDecodeInterleaved = {str(interleaved).lower()};"))
    values = {"fc1": str(fc1).lower(), "fc2": str(fc2).lower(), "ws": str(decoders),
              "fc1_body": (LAB / "fc1_ws.inc").read_text() + "\n" + (LAB / "fc1_decoded.inc").read_text(),
              "fc2_body": (LAB / "fc2_decoded.inc").read_text()}
    for name, old, new in EDITS:
        path = target / name
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"kernels/{name}: the text to patch is not there once: {old[:60]!r}")
        for key, value in values.items():
            new = new.replace("{" + key + "}", value)
        path.write_text(text.replace(old, new))
    return target


def variant_sources(name: str, fc1: bool, fc2: bool, interleaved: bool, decoders: int) -> Path:
    return write_sources(build.cache_dir() / "decoded-sources" / name, fc1, fc2, interleaved, decoders)


def parse_flags(values: str) -> tuple[bool, bool, bool, int]:
    """FC1,FC2,INTERLEAVED[,DECODERS]: three 0-or-1 flags and a count of decoder warps (default 0)."""
    bits = values.split(",")
    if len(bits) not in (3, 4) or any(b not in ("0", "1") for b in bits[:3]) or not bits[-1].isdigit():
        raise SystemExit(f"{values}: expected FC1,FC2,INTERLEAVED[,DECODERS], the first three 0 or 1")
    decoders = int(bits[3]) if len(bits) == 4 else 0
    if decoders and (bits[0] != "1" or decoders % 2 or 32 % decoders):
        raise SystemExit(f"{values}: DECODERS needs FC1 = 1 and a count of 2, 4, 8, 16 or 32 warps")
    return bits[0] == "1", bits[1] == "1", bits[2] == "1", decoders


def build_one(spec: str) -> tuple[str, str]:
    if "=" not in spec:
        return spec, str(build.build_library("sm_90", codebook="mcg", kernels=spec, jobs=3).path)
    name, rest = spec.split("=", 1)
    values, _, kernels = rest.partition(":")
    extension = build.BuildExtension(name, variant_sources(name, *parse_flags(values)))
    return name, str(build.build_library("sm_90", codebook="mcg", kernels=kernels or "k3k4", jobs=3,
                                         extension=extension).path)


def main() -> None:
    if sys.argv[1:2] == ["sources"]:  # sources DIR FC1,FC2,INTERLEAVED[,DECODERS]
        write_sources(Path(sys.argv[2]), *parse_flags(sys.argv[3]))
        return
    with ProcessPoolExecutor(max_workers=6) as pool:
        for name, path in pool.map(build_one, sys.argv[1:]):
            print(name, path, flush=True)


if __name__ == "__main__":
    main()
