// Decoded tiles, a lab variant of the 128-row FC1 and FC2 of builds without wgmma (lab/perf/decoded_variants.py
// copies kernels/, adds this header and fc1_decoded.inc / fc2_decoded.inc, and switches them on with
// kDecodedFc1 / kDecodedFc2 in the copy's gemm_tile.cuh): each staged chunk of weights is decoded once per CTA
// into shared memory as fp16, and every warp multiplies a 64-row x 32-feature block of the tile from it.
//
// Against chunk_mma's warps of 128 rows x 16 features, whose B fragments stay in registers, each A fragment read
// with ldmatrix feeds 4 MMAs instead of 2: 192 bytes of shared memory read per m16n8k16 instead of 256. The
// decode of chunk c + 1 and the MMAs of chunk c share one barrier interval, so warps decoding and warps
// multiplying overlap. A decoded 16x16 tile is stored in fragment order (lane l's four B registers at bytes
// 16l .. 16l + 15): lanes write and read 512 contiguous bytes with one 16-byte access each, free of bank
// conflicts, and the result is bit for bit chunk_mma's (the same fp16 weights, the same k order per
// accumulator).
#pragma once
#include "chunk_mma.cuh"
#include "copy_pipeline.cuh"

namespace trellis {

// Per projection: a chunk of KT k tiles x 8 n tiles, 128 words (512 bytes) per decoded tile.
template <int P, int KT>
struct DecodedChunk {
  static constexpr int kTiles = P * KT * 8;
  static constexpr int kWords = kTiles * 128;
};

// k tiles per staged chunk: FC1 (two projections' A rows per stage) 2, FC2 4.
constexpr int kDecodedFc1Kt = 2, kDecodedFc2Kt = 4;
constexpr int kDecodedWStages = 3, kDecodedAStages = 2;
// The next chunk's decode spread over the k tiles of the current chunk's MMAs (else all before them).
constexpr bool kDecodeInterleaved = true;

__host__ __device__ constexpr int decoded_smem_bytes(int projections, int kt, bool fast) {
  return kDecodedWStages * projections * kt * 64 * max_k(fast) * 4 +
         kDecodedAStages * projections * 128 * a_stride(8, kt) * 2 + 2 * projections * kt * 8 * 512;
}
__host__ __device__ constexpr int decoded_fc1_smem_bytes(bool fast) { return decoded_smem_bytes(2, kDecodedFc1Kt, fast); }
__host__ __device__ constexpr int decoded_fc2_smem_bytes(bool fast) {
  return decoded_smem_bytes(1, kDecodedFc2Kt, fast) > 128 * kOStride * 4 ? decoded_smem_bytes(1, kDecodedFc2Kt, fast)
                                                                          : 128 * kOStride * 4;
}

// The staged words of a chunk (P x KT runs of 8 n tiles, 64K words each: WeightIssue's layout) decoded into
// `out`, tile t = (projection * KT + k tile) * 8 + n tile; the CTA's WARPS warps share the tiles.
// PARTS > 1: only the warp's tiles of part `part` (of PARTS equal parts), so that a chunk's decode can be
// spread over the k steps of the previous chunk's MMAs.
template <int K, int CB, int P, int KT, int WARPS, int PARTS = 1>
__device__ __forceinline__ void decode_chunk(const uint32_t* words, uint32_t* out, const LaneWindow& win, int warp,
                                             int lane, int part = 0) {
  constexpr int kTiles = DecodedChunk<P, KT>::kTiles, kPerWarp = kTiles / WARPS;
  static_assert(kTiles % WARPS == 0 && kPerWarp % PARTS == 0, "every warp decodes as many tiles");
#pragma unroll
  for (int j = 0; j < kPerWarp / PARTS; ++j) {
    const int i = part * (kPerWarp / PARTS) + j;
    const int t = warp + i * WARPS;
    const uint32_t* w = words + (t >> 3) * 64 * K + (t & 7) * 8 * K;
    TileWords tw;
    tw.u0 = w[win.w0];
    tw.u1 = w[win.w1];
    tw.u2 = K >= 5 ? w[win.w2] : 0u;
    uint32_t b[4];
    decode_fragments<K, CB>(tw, win, b);
    *reinterpret_cast<uint4*>(out + t * 128 + lane * 4) = make_uint4(b[0], b[1], b[2], b[3]);
  }
}

// The warp's block of one projection: m16 blocks wm, wm + 2, wm + 4, wm + 6 (interleaved, so that a tile's
// last, partly live blocks spread over both row halves) x features 32 wn .. 32 wn + 31. acc[i][n]: block
// 2i + wm, features 32 wn + 8n .. + 7. `tiles`: the projection's decoded tiles of the chunk; a_addr: the lane's
// ldmatrix address of the projection's block 0, k tile 0 (a_lane_address).
// between(kt) runs before k tile kt's MMAs (INTERLEAVE: the next chunk's decode, a part per k tile, whose
// integer work then issues while the previous k tile's MMAs are in flight).
template <int KT, typename Between>
__device__ __forceinline__ void decoded_mma(const uint32_t* tiles, uint32_t a_addr, int wm, int wn, int live,
                                            int lane, float (&acc)[4][4][4], Between&& between) {
  constexpr int kAStride = a_stride(8, KT);
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    between(kt);
    const uint4 b0 = *reinterpret_cast<const uint4*>(tiles + (kt * 8 + 2 * wn) * 128 + lane * 4);
    const uint4 b1 = *reinterpret_cast<const uint4*>(tiles + (kt * 8 + 2 * wn + 1) * 128 + lane * 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (2 * i + wm < live) {
        uint32_t af[4];
        ldmatrix_x4(af, a_addr + 2 * ((2 * i + wm) * 16 * kAStride + kt * 16));
        mma_16816(acc[i][0], af, b0.x, b0.y);
        mma_16816(acc[i][1], af, b0.z, b0.w);
        mma_16816(acc[i][2], af, b1.x, b1.y);
        mma_16816(acc[i][3], af, b1.z, b1.w);
      }
    }
  }
}

__device__ __forceinline__ void zero_acc4(float (&acc)[4][4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.f;
}

// The pipeline: weights of chunk c + 2 and A rows of chunk c + 1 are issued while chunk c + 1 is decoded and
// chunk c multiplied, one barrier per chunk. Weights (3 stages) run a chunk ahead of the A rows (2 stages) so
// that a chunk's words have landed a step before its rows are needed. issue_w / issue_a(c, stage),
// decode(c, w_stage, buffer), mma(c, a_stage, buffer); the weights of chunks 0 and 1 are issued before
// after_wait (they never depend on the previous kernel).
template <typename IssueW, typename IssueA, typename AfterWait, typename Decode, typename Mma>
__device__ __forceinline__ void decoded_chunks(int chunks, IssueW&& issue_w, IssueA&& issue_a, AfterWait&& after_wait,
                                               Decode&& decode, Mma&& mma) {
  static_assert(kDecodedWStages == 3 && kDecodedAStages == 2, "the stage walk below");
  issue_w(0, 0);
  if (chunks > 1) issue_w(1, 1);
  cp_async_commit();
  after_wait();
  issue_a(0, 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  decode(0, 0, 0);
  int w_next = 2;  // the weight stage of chunk c + 2
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait<0>();  // A rows of chunk c, words of chunk c + 1
    __syncthreads();     // and chunk c's decoded tiles are visible; chunk c - 1's stages and buffer are free
    if (c + 1 < chunks) issue_a(c + 1, (c + 1) & 1);
    if (c + 2 < chunks) issue_w(c + 2, w_next);
    cp_async_commit();
    // the next chunk's decode: whole here, or (kDecodeInterleaved) a part before each k tile of mma
    if (!kDecodeInterleaved && c + 1 < chunks) decode(c + 1, w_next == 0 ? 2 : w_next - 1, (c + 1) & 1);
    mma(c, c & 1, c & 1, c + 1 < chunks ? (w_next == 0 ? 2 : w_next - 1) : -1);
    w_next = w_next == 2 ? 0 : w_next + 1;
  }
  cp_async_wait<0>();
}

}  // namespace trellis
