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

  for (int i = threadIdx.x; i < num_combined; i += blockDim.x) count[i] = 0;
  __syncthreads();
  for (int r = threadIdx.x; r < numel; r += blockDim.x) {
    const int c = route_combined(a, r);
    if (c >= 0) atomicAdd(&count[c], 1);
  }
  __syncthreads();
  pack_prefix(a, count, slot_base, tile_base, static_cast<int*>(a.tile_count));
  __syncthreads();
  pack_tiles(a, count, slot_base, tile_base);
  __syncthreads();  // slot_base becomes the scatter cursor

  int* slot_route = static_cast<int*>(a.slot_route);
  for (int r = threadIdx.x; r < numel; r += blockDim.x) {
    const int c = route_combined(a, r);
    if (c < 0) continue;
    const int slot = atomicAdd(&slot_base[c], 1);
    if (slot < a.slot_capacity) slot_route[slot] = r;
  }
}

// The wide pack, from kWidePackFrom routes on. The one-CTA pack's time grows with its 2 x numel shared
// atomics on num_combined counters (44 us at M=3072, top-8, on H200). Here each CTA takes kPackThreads
// routes: route_count_kernel counts them per expert, then route_scatter_kernel, on the same grid, adds up
// every CTA's counts (the totals, and the part of CTAs before its own), derives the same prefix and tile
// list as route_pack_kernel and scatters its routes from its own cursor. Inside an expert's segment routes
// then sit CTA by CTA, in atomic order within a CTA: no result depends on that order.
// Scratch: the per-CTA counts [ctas][num_combined] and each route's combined id [numel], at the start of
// route_out. FC2 writes route_out only after the rotation and FC1 have read everything the pack made, and
// the count kernel, the call's first, starts only when the previous call has finished. route_out holds
// numel * hidden floats; the scratch needs (numel / kPackThreads + 1) * num_combined + numel <= 4 numel.
constexpr int kWidePackFrom = 4096;

__device__ __forceinline__ int* wide_pack_counts(const TrellisMoeArgs& a) { return static_cast<int*>(a.route_out); }
__device__ __forceinline__ int* wide_pack_combined(const TrellisMoeArgs& a) {
  return wide_pack_counts(a) + size_t(gridDim.x) * a.num_combined;
}

// Shared memory: 1 int32 per combined expert.
__global__ void __launch_bounds__(kPackThreads) route_count_kernel(const TrellisMoeArgs a) {
  TRELLIS_TIMELINE_SCOPE(kTlPack);
  allow_dependents();
  extern __shared__ int pack_smem[];
  int* count = pack_smem;
  for (int i = threadIdx.x; i < a.num_combined; i += blockDim.x) count[i] = 0;
  __syncthreads();
  const int r = blockIdx.x * kPackThreads + threadIdx.x;
  if (r < a.m * a.top_k) {
    const int c = route_combined(a, r);
    wide_pack_combined(a)[r] = c;
    if (c >= 0) atomicAdd(&count[c], 1);
  }
  __syncthreads();
  int* counts = wide_pack_counts(a) + size_t(blockIdx.x) * a.num_combined;
  for (int i = threadIdx.x; i < a.num_combined; i += blockDim.x) counts[i] = count[i];
}

// Shared memory: 4 int32 per combined expert.
__global__ void __launch_bounds__(kPackThreads) route_scatter_kernel(const TrellisMoeArgs a) {
  TRELLIS_TIMELINE_SCOPE(kTlPack);
  extern __shared__ int pack_smem[];
  const int num_combined = a.num_combined;
  int* count = pack_smem;
  int* cursor = count + num_combined;
  int* slot_base = cursor + num_combined;
  int* tile_base = slot_base + num_combined;
  after_predecessor();
  const int* counts = wide_pack_counts(a);
  for (int i = threadIdx.x; i < num_combined; i += blockDim.x) {
    int total = 0, before = 0;
    for (int j = 0; j < gridDim.x; ++j) {
      if (j == blockIdx.x) before = total;
      total += counts[size_t(j) * num_combined + i];
    }
    count[i] = total;
    cursor[i] = before;
  }
  __syncthreads();
  pack_prefix(a, count, slot_base, tile_base, blockIdx.x == 0 ? static_cast<int*>(a.tile_count) : nullptr);
  __syncthreads();
  if (blockIdx.x == 0) pack_tiles(a, count, slot_base, tile_base);
  for (int i = threadIdx.x; i < num_combined; i += blockDim.x) cursor[i] += slot_base[i];
  __syncthreads();
  const int r = blockIdx.x * kPackThreads + threadIdx.x;
  if (r < a.m * a.top_k) {
    const int c = wide_pack_combined(a)[r];
    if (c >= 0) {
      const int slot = atomicAdd(&cursor[c], 1);
      if (slot < a.slot_capacity) static_cast<int*>(a.slot_route)[slot] = r;
    }
  }
}

}  // namespace trellis
