// The input rotation kernels (expert_gemm.cuh): FC1's A rows, rotated once per route or per token.
#pragma once
#include "gemm_tile.cuh"
#include "handover.cuh"
#include "warp_ops.cuh"

namespace trellis {

// ---------------------------------------------------------------------------------------------------
// Input rotation, once per route: xrot[slot][p] = fp16(H128(x[token] ⊙ suh_p)) for p = gate, up, in the
// FC1 kernel's A layout (every column once for 128-row tiles, twice for 16- and 32-row tiles).

// 128-row tiles: grid (tiles, H / (128 * blocks)), 8 warps, each CTA `blocks` (1, 2 or 4) column blocks of
// 128: more than one where the tiles hold few rows (M=512: about 16), so the CTA's groups have work. Each
// group of 4 lanes rotates one (row, block, projection) per step, 32 columns per lane in runs of 8: half
// the shuffles of 16-lane groups and fewer instructions (the kernel is issue-bound, not memory-bound).
// The two projections of a row sit in neighbouring groups, so their loads of x meet
// in the same sectors.
constexpr int kMaxRotateBlocks = 4;
template <bool kBf16>
__global__ void __launch_bounds__(256, 4) rotate_input_kernel(const TrellisMoeArgs a) {
  constexpr int G = 4, N = 128 / G, kItemsPerWarp = 16 / G;
  // The CTA's suh columns of both projections, times 1/sqrt(128); the pad of 4 floats puts the two
  // projections' 16-byte reads in different banks.
  __shared__ __align__(16) float s_suh[kMaxRotateBlocks][2][132];
  after_predecessor();  // the tile list comes from the route pack, launched just before
  WorkTile w;
  if (!load_work_tile(a, blockIdx.x, w)) return;
  const int log2_blocks = __ffs((a.hidden >> 7) / gridDim.y) - 1;  // rotation_for: 1, 2 or 4 blocks
  const int block0 = blockIdx.y << log2_blocks;
  if (threadIdx.x < (32 << log2_blocks)) {
    const int b = threadIdx.x >> 5, p = (threadIdx.x >> 4) & 1, c = 8 * (threadIdx.x & 15);
    input_suh8(a, w.expert, p, (block0 + b) * 128 + c, &s_suh[b][p][c]);
  }
  __syncthreads();
  const int q = threadIdx.x % G, group = threadIdx.x / G, warp = warp_index();
  const int p = group & 1;
  const int items = w.rows << log2_blocks;  // item = row * blocks + block
  // Whole warps step together (the shuffles name the whole warp); a group past the tile's items idles.
  for (int i0 = kItemsPerWarp * warp; i0 < items; i0 += 8 * kItemsPerWarp) {
    const int item = i0 + (group >> 1) % kItemsPerWarp;
    const bool live = item < items;
    const int row = item >> log2_blocks, b = item & ((1 << log2_blocks) - 1);
    const int col0 = (block0 + b) * 128;
    float v[N];
    if (live) {
      const size_t token = slot_token(a, w.start + row);
#pragma unroll
      for (int j = 0; j < N / 8; ++j) load_x8(a, kBf16, token, col0 + 8 * G * j + 8 * q, v + 8 * j);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 s = *reinterpret_cast<const float4*>(&s_suh[b][p][8 * G * (i / 8) + 8 * q + i % 8]);
      v[i] *= s.x;
      v[i + 1] *= s.y;
      v[i + 2] *= s.z;
      v[i + 3] *= s.w;
    }
    hadamard128_unscaled<G>(v, q);
    if (live) {
      __half* dst = static_cast<__half*>(a.xrot) + (size_t(w.start + row) * 2 + p) * a.hidden;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) store_a_row8(dst, col0 + 8 * G * j + 8 * q, 1, v + 8 * j);
    }
  }
}

// 16- and 32-row tiles hold a route or two each at small M, so a CTA per (tile, 128 columns) kept most of
// its warps idle (M=8: 3264 CTAs for 64 routes, 11 µs on the critical path). Here a CTA takes
// kSmallRotateBlocks column blocks of one route: grid (routes, ceil(H / (128 * kSmallRotateBlocks))), 8
// warps, one column block each, a half warp per projection, 8 columns per lane (rotate8), suh read
// straight from global memory. Rows are kept per route (route_rows), so the kernel needs nothing from the
// route pack: it rotates while the pack runs and waits for the pack only before it lets FC1 launch (FC1
// reads the tile list before its own wait; launching the rotation before the pack let FC1 read the list
// before it was written). With rows_by_token the grid's x
// is the token and the rows are plain for 128-row tiles.
constexpr int kSmallRotateBlocks = 8;
template <bool kBf16>
__global__ void __launch_bounds__(256) rotate_routes_kernel(const TrellisMoeArgs a) {
  const int row = blockIdx.x, lane = threadIdx.x & 15, p = (threadIdx.x >> 4) & 1, warp = warp_index();
  const int col = (blockIdx.y * kSmallRotateBlocks + warp) * 128 + 8 * lane;
  const bool by_token = rows_by_token(a);
  const int expert = by_token ? 0 : route_combined(a, row);  // by token: the shared suh rows
  const int expand = expand_of_m_tile(a.m_tile);
  if (col < a.hidden && expert >= 0) {  // a route not served here: FC1 never reads its row
    float x[8], s[8], v[8];
    load_x8(a, kBf16, by_token ? row : row / a.top_k, col, x);
    input_suh8(a, expert, p, col, s);
    rotate8(x, s, lane, v);
    store_a_row8(static_cast<__half*>(a.xrot) + (size_t(row) * 2 + p) * expand * a.hidden, col, expand, v);
  }
  after_predecessor();
}

}  // namespace trellis
