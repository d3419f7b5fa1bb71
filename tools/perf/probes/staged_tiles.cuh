// The decode probes' workload: kTiles random 16x16 trellis tiles held in shared memory, which every warp
// walks from its own first tile, and stand-ins for one block of 8 routes' activation fragments.
#pragma once
#include <stdint.h>

#include "../../../kernels/decode.cuh"

constexpr int kTiles = 64;

// The lane's words of staged tile `tile` (s_w: kTiles tiles of 8K words); warp_tile: the tile a warp
// takes at step kt.
template <int K>
__device__ __forceinline__ trellis::TileWords staged_tile(const uint32_t* s_w, int tile,
                                                         const trellis::LaneWindow& win) {
  trellis::TileWords t;
  t.u0 = s_w[tile * 8 * K + win.w0];
  t.u1 = s_w[tile * 8 * K + win.w1];
  t.u2 = 0;
  return t;
}
__device__ __forceinline__ int warp_tile(int kt, int warp) { return (kt + warp) & (kTiles - 1); }

// Route operand stand-ins (fp16 pairs, different per lane, never zero).
__device__ __forceinline__ void route_stand_ins(int lane, uint32_t rows[4]) {
  rows[0] = 0x3C003C00u ^ lane;
  rows[1] = 0x3C00BC00u;
  rows[2] = 0xBC003C00u + lane;
  rows[3] = 0x38003800u;
}
