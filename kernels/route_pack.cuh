// On-device route pack: count, block-padded prefix, tile ownership and scatter, in one CTA.
//
// Routes (token, k) are grouped by combined expert id. Each expert's segment of slots is padded to a
// multiple of 16 rows (one MMA m16 block) and cut into work tiles of m_tile rows. Tiles are listed in
// combined-expert order, so the tile list is deterministic; the order of routes inside a segment is the
// order of atomics, which no result depends on (every row is computed on its own, every tile of one expert
// sums FC1's planes alike (fc1_split.cuh), and results are written by route id). trellis_cli/kernel/plan.py mirrors this algorithm in Python for the CPU tests.
// The kernels themselves are in route_pack_kernels.cuh.
#pragma once
#include "abi.h"
#include "warp_ops.cuh"

namespace trellis {

// The three steps of a route's lookup: its global expert id, that expert's combined id (-1 when out of
// range or unmapped), and whether the combined id's descriptor names a stored expert.
__device__ __forceinline__ long long route_expert(const TrellisMoeArgs& a, int r) {
  return a.ids_int64 ? static_cast<const long long*>(a.topk_ids)[r]
                     : static_cast<long long>(static_cast<const int*>(a.topk_ids)[r]);
}
__device__ __forceinline__ int expert_combined(const TrellisMoeArgs& a, long long e) {
  if (e < 0 || e >= a.num_experts) return -1;
  const int c = static_cast<const int*>(a.global_to_combined)[e];
  return c < 0 || c >= a.num_combined ? -1 : c;
}
__device__ __forceinline__ bool combined_stored(const TrellisMoeArgs& a, int c) {
  const int d = static_cast<const int*>(a.descriptors)[c];
  if (d < 0) return false;
  const int tier = d >> 8, local = d & 0xFF;
  return tier < a.num_tiers && local < a.tier_size[tier];
}

// Combined id of route r, or -1 when the expert is out of range, unmapped or skipped.
__device__ __forceinline__ int route_combined(const TrellisMoeArgs& a, int r) {
  const int c = expert_combined(a, route_expert(a, r));
  return c >= 0 && combined_stored(a, c) ? c : -1;
}

// Bit k set when route first + k (k < count <= 32) is served here (route_combined >= 0). Each step's loads
// for 8 routes are issued together: three dependent round trips per 8 routes instead of per route.
__device__ __forceinline__ uint32_t served_mask(const TrellisMoeArgs& a, int first, int count) {
  uint32_t mask = 0;
  for (int k0 = 0; k0 < count; k0 += 8) {
    long long e[8];
    int c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = k0 + j < count ? route_expert(a, first + k0 + j) : -1;
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = expert_combined(a, e[j]);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (c[j] >= 0 && combined_stored(a, c[j])) mask |= 1u << (k0 + j);
  }
  return mask;
}

constexpr int kPackThreads = 1024;

// Exclusive prefix of padded slots and of tiles over the experts' route counts (warp 0 of the CTA; the
// caller syncs before and after): slot_base[i], tile_base[i], and the tile count into *tile_total unless null.
__device__ __forceinline__ void pack_prefix(const TrellisMoeArgs& a, const int* count, int* slot_base,
                                            int* tile_base, int* tile_total) {
  if (warp_index() != 0) return;  // warp-uniform, so the shuffles below stay single instructions
  const int lane = threadIdx.x, num_combined = a.num_combined, m_tile = a.m_tile;
  int slot_run = 0, tile_run = 0;
  for (int c0 = 0; c0 < num_combined; c0 += 32) {  // 32 experts at a time
    const int i = c0 + lane;
    const int n = i < num_combined ? count[i] : 0;
    const int padded = (n + 15) & ~15;
    const int tiles = (n + m_tile - 1) / m_tile;
    int ps = padded, ts = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xFFFFFFFFu, ps, o);
      const int z = __shfl_up_sync(0xFFFFFFFFu, ts, o);
      if (lane >= o) {
        ps += y;
        ts += z;
      }
    }
    if (i < num_combined) {
      slot_base[i] = slot_run + ps - padded;
      tile_base[i] = tile_run + ts - tiles;
    }
    slot_run += __shfl_sync(0xFFFFFFFFu, ps, 31);
    tile_run += __shfl_sync(0xFFFFFFFFu, ts, 31);
  }
  if (lane == 0 && tile_total != nullptr) *tile_total = min(tile_run, a.tile_capacity);
}

// The tile list in combined-expert order (every thread of the CTA).
__device__ __forceinline__ void pack_tiles(const TrellisMoeArgs& a, const int* count, const int* slot_base,
                                           const int* tile_base) {
  int* tile_expert = static_cast<int*>(a.tile_expert);
  int* tile_start = static_cast<int*>(a.tile_start);
  int* tile_rows = static_cast<int*>(a.tile_rows);
  for (int i = threadIdx.x; i < a.num_combined; i += blockDim.x) {
    const int n = count[i];
    for (int j = 0; j * a.m_tile < n; ++j) {
      const int t = tile_base[i] + j;
      if (t >= a.tile_capacity) break;
      tile_expert[t] = i;
      tile_start[t] = slot_base[i] + j * a.m_tile;
      tile_rows[t] = min(a.m_tile, n - j * a.m_tile);
    }
  }
}

}  // namespace trellis
