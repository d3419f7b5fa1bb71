// The route-pack kernels (route_pack.cuh holds the steps they share with FC1 and the activation).
// Non-template kernels are defined in every translation unit that includes them, so only the library's
// host unit (trellis_moe.cu) includes this file.
#pragma once
#include "abi.h"
#include "route_pack.cuh"
#include "warp_ops.cuh"

namespace trellis {

// Shared memory: 3 int32 per combined expert.
__global__ void __launch_bounds__(kPackThreads) route_pack_kernel(const TrellisMoeArgs a) {
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
// then sit CTA by CTA, in atomic order within a CTA: no result depends on that order (route_pack.cuh).
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
