// One staged chunk decoded and multiplied into a work tile's accumulators on mma.sync (expert_gemm.cuh),
// the accumulator layout, and the dispatch on the tile's K.
#pragma once
#include "decode.cuh"
#include "gemm_tile.cuh"
#include "warp_ops.cuh"

namespace trellis {

// Decode the KT k tiles (8, or 4 where FC1 stages half chunks: fc1_chunk_tiles) of n tile `ntl` from a staged
// run and multiply them into the live route blocks.
//
// Small tiles (split words) run the product transposed, y^T = W^T x^T: the lane's 8 codebook words are,
// reordered, its A fragments of W^T (16 features x 32 expanded k: even states, then odd states), and the
// tile's routes are the MMA's n = 8. acc[r][h] holds routes 16r + 8h .. +7 and `live` counts those 8-route
// blocks, so a tile of up to 8 routes takes 2 MMAs per weight tile where a 16-row A block took 4.
// Large tiles (merged fp16 weights) keep W as B against 16-row A blocks: acc[r][n] holds routes
// 16r .. 16r + 15 and features 8n .. 8n + 7 of the n tile, and `live` counts m16 blocks.
// a_addr: this lane's ldmatrix address for k tile 0 (a_lane_address).
template <int K, int CB, int R, int KT = 8>
__device__ __forceinline__ void chunk_mma(const uint32_t* run, int ntl, const LaneWindow& win, uint32_t a_addr,
                                          int live, float (&acc)[R][2][4]) {
  constexpr int kAStride = a_stride(R, KT);
  // The lane's words of k tile 0; k tile kt is a constant offset away (folds into the LDS).
  const uint32_t* w0 = run + ntl * 8 * K + win.w0;
  const uint32_t* w1 = run + ntl * 8 * K + win.w1;
  const uint32_t* w2 = run + ntl * 8 * K + win.w2;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    TileWords t;
    t.u0 = w0[kt * 64 * K];
    t.u1 = w1[kt * 64 * K];
    t.u2 = K >= 5 ? w2[kt * 64 * K] : 0u;
    if (a_expand(R) == 2) {
      uint32_t x[8];
      decode_words<K, CB>(t, win, x);
      // As B, word j sat at k rows 2t | 2t+8 and n column g | g+8; as A of W^T the same words are rows
      // g | g+8 at those k.
      const uint32_t even[4] = {x[0], x[4], x[2], x[6]}, odd[4] = {x[1], x[5], x[3], x[7]};
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (2 * r + h < live) {
            uint32_t routes[4];  // 8 routes x 32 expanded k: the even k16 in [0], [1], the odd in [2], [3]
            ldmatrix_x4(routes, a_addr + 2 * ((16 * r + 8 * h) * kAStride + kt * 32));
            mma_16816(acc[r][h], even, routes[0], routes[1]);
            mma_16816(acc[r][h], odd, routes[2], routes[3]);
          }
        }
      }
      continue;
    }
    uint32_t b[4];
    decode_fragments<K, CB>(t, win, b);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < live) {
        uint32_t af[4];
        ldmatrix_x4(af, a_addr + 2 * (r * 16 * kAStride + kt * 16));
        mma_16816(acc[r][0], af, b[0], b[1]);
        mma_16816(acc[r][1], af, b[2], b[3]);
      }
    }
  }
}

// The blocks of a tile of `rows` routes that chunk_mma multiplies: 8-route blocks for small tiles, m16
// blocks for large ones.
template <int R>
__device__ __forceinline__ int live_blocks(int rows) {
  return small_tile(R) ? (rows + 7) >> 3 : (rows + 15) >> 4;
}

// Rows past the tile's routes, up to its last live block, stay zero in every stage (cp.async never writes
// them).
template <int R, int KT = 8>
__device__ __forceinline__ void zero_dead_rows(__half* a, int sources, int rows) {
  constexpr int kPieces = 2 * KT * a_expand(R), kStride = a_stride(R, KT);
  const int dead = live_blocks<R>(rows) * (small_tile(R) ? 8 : 16) - rows;
  for (int i = threadIdx.x; i < sources * dead * kPieces; i += blockDim.x) {
    const int p = i / (dead * kPieces), rest = i - p * dead * kPieces;
    *reinterpret_cast<uint4*>(a + (p * R * 16 + rows + rest / kPieces) * kStride + (rest % kPieces) * 8) =
        make_uint4(0u, 0u, 0u, 0u);
  }
}

// The lane's ldmatrix address in a staged tile of rows at shared address `tile` (rows a_stride(R) halves
// apart). Small tiles, B of 8 routes x 32 expanded k: lane l names route l % 8, columns 8 * (l / 8) on.
// Large tiles, A of 16 routes x 16 k: lane l names route l % 16, columns 8 * (l / 16) on.
template <int R, int KT = 8>
__device__ __forceinline__ uint32_t a_lane_address(uint32_t tile, int lane) {
  if (small_tile(R)) return tile + 2 * ((lane & 7) * a_stride(R, KT) + (lane >> 3) * 8);
  return tile + 2 * ((lane & 15) * a_stride(R, KT) + (lane >> 4) * 8);
}

// Where a small tile's accumulator acc[r][h][e] (chunk_mma, transposed) belongs, for lane 4g + q: route
// 16r + 8h + 2q + e % 2 of the tile, feature g + 8 (e / 2) of the warp's 16.
__host__ __device__ constexpr int small_acc_route(int r, int h, int e, int q) { return 16 * r + 8 * h + 2 * q + (e & 1); }
__host__ __device__ constexpr int small_acc_feature(int e, int g) { return g + 8 * (e >> 1); }

// Calls f(route, feature, value) for each of the lane's accumulators of a small tile whose route is below
// `rows`: the route within the tile, the feature within the warp's 16.
template <int R, typename F>
__device__ __forceinline__ void for_each_small_acc(const float (&acc)[R][2][4], int lane, int rows, F&& f) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int route = small_acc_route(r, h, e, q);
        if (route < rows) f(route, small_acc_feature(e, g), acc[r][h][e]);
      }
}

template <int R>
__device__ __forceinline__ void zero_acc(float (&acc)[R][2][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;
}

// Hides how v was computed, so the compiler keeps it in a register instead of recomputing it from the lane
// index at every use (which it does inside FC2's block loop: 4 instructions per ldmatrix).
template <typename T>
__device__ __forceinline__ void opaque(T& v) {
  asm volatile("" : "+r"(v));
}

// Calls body(IntConst<K>{}) for the tile's K. FAST: the tiers use only K3 and K4. Register allocation is the
// maximum over every compiled K, so a kernel holding just those two fits 2 CTAs (32 warps) per SM where
// the all-K kernel fits one.
template <int V>
struct IntConst {
  static constexpr int value = V;
};
template <bool FAST, typename Body>
__device__ __forceinline__ void with_k(int k, Body&& body) {
  if (FAST) {
    if (k == 3) body(IntConst<3>{});
    else body(IntConst<4>{});
    return;
  }
  switch (k) {
    case 1: body(IntConst<1>{}); break;
    case 2: body(IntConst<2>{}); break;
    case 3: body(IntConst<3>{}); break;
    case 4: body(IntConst<4>{}); break;
    case 5: body(IntConst<5>{}); break;
    case 6: body(IntConst<6>{}); break;
    case 7: body(IntConst<7>{}); break;
    case 8: body(IntConst<8>{}); break;
    default: break;
  }
}

}  // namespace trellis
