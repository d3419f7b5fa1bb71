// On-device route pack: count, block-padded prefix, tile ownership and scatter, in one CTA.
//
// Routes (token, k) are grouped by combined expert id. Each expert's segment of slots is padded to a
// multiple of 16 rows (one MMA m16 block) and cut into work tiles of m_tile rows. Tiles are listed in
// combined-expert order, so the tile list is deterministic; the order of routes inside a segment is the
// order of atomics, which no result depends on (every row is computed on its own and results are written
// by route id). trellis_cli/kernel/plan.py mirrors this algorithm in Python for the CPU tests.
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

// Shared memory: 3 int32 per combined expert.
__global__ void __launch_bounds__(kPackThreads) route_pack_kernel(const TrellisMoeArgs a) {
  TRELLIS_TIMELINE_SCOPE(kTlPack);
  allow_dependents();  // the next kernel may launch now; it waits for this one before reading anything
  extern __shared__ int pack_smem[];
  const int num_combined = a.num_combined;
  int* count = pack_smem;
  int* slot_base = count + num_combined;
  int* tile_base = slot_base + num_combined;
  const int numel = a.m * a.top_k;
  const int m_tile = a.m_tile;
  int* tile_expert = static_cast<int*>(a.tile_expert);
  int* tile_start = static_cast<int*>(a.tile_start);
  int* tile_rows = static_cast<int*>(a.tile_rows);

  for (int i = threadIdx.x; i < num_combined; i += blockDim.x) count[i] = 0;
  __syncthreads();
  for (int r = threadIdx.x; r < numel; r += blockDim.x) {
    const int c = route_combined(a, r);
    if (c >= 0) atomicAdd(&count[c], 1);
  }
  __syncthreads();

  if (threadIdx.x < 32) {  // exclusive prefix of padded slots and of tiles, 32 experts at a time
    const int lane = threadIdx.x;
    int slot_run = 0, tile_run = 0;
    for (int c0 = 0; c0 < num_combined; c0 += 32) {
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
    if (lane == 0) *static_cast<int*>(a.tile_count) = min(tile_run, a.tile_capacity);
  }
  __syncthreads();

  for (int i = threadIdx.x; i < num_combined; i += blockDim.x) {
    const int n = count[i];
    for (int j = 0; j * m_tile < n; ++j) {
      const int t = tile_base[i] + j;
      if (t >= a.tile_capacity) break;
      tile_expert[t] = i;
      tile_start[t] = slot_base[i] + j * m_tile;
      tile_rows[t] = min(m_tile, n - j * m_tile);
    }
  }
  __syncthreads();  // slot_base becomes the scatter cursor

  int* slot_route = static_cast<int*>(a.slot_route);
  for (int r = threadIdx.x; r < numel; r += blockDim.x) {
    const int c = route_combined(a, r);
    if (c < 0) continue;
    const int slot = atomicAdd(&slot_base[c], 1);
    if (slot < a.slot_capacity) slot_route[slot] = r;
  }
}

}  // namespace trellis
