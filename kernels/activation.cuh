// The activation between FC1 and FC2, and the fixed-order top-k sum.
//
// activation: per route, add the FC1 partial sums of every k range in order, rotate gate and up back
// (H128, svh), SiLU(gate) * up, then rotate into FC2's input basis (suh of down, H128) and store fp16.
// sum: out[t] = sum over k in order 0..top_k-1 of the routes' rotated, weighted FC2 outputs; a route
// whose expert is not served here is skipped, so it contributes exactly zero.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "abi.h"
#include "expert_gemm.cuh"
#include "route_pack.cuh"
#include "warp_ops.cuh"

namespace trellis {

// grid (tile_capacity, row_steps), one warp per 128-channel block of the intermediate dim; each half warp
// takes one route row per step (8 channels per lane, as the input rotation of small tiles: the kernel is
// issue-bound).
__global__ void activation_kernel(const TrellisMoeArgs a) {
  WorkTile w;
  if (!load_work_tile(a, blockIdx.x, w)) return;
  const int lane = threadIdx.x & 15, half = (threadIdx.x >> 4) & 1, block = threadIdx.x >> 5;
  const int inter = a.intermediate;
  const int col = block * 128 + 8 * lane;
  const __half* rot = static_cast<const __half*>(a.rot_intermediate) + size_t(w.expert) * 3 * inter;
  // Layer inputs, read while FC1 drains. Each H128 is unscaled: its 1/sqrt(128) rides on the vector
  // that multiplies its result.
  float svh_g[8], svh_u[8], suh_d[8];
  load8_rotation_scaled(rot + col, svh_g);
  load8_rotation_scaled(rot + inter + col, svh_u);
  load8_rotation_scaled(rot + 2 * inter + col, suh_d);
  after_predecessor();
  const size_t split_stride = size_t(a.slot_capacity) * 2 * inter;
  const int expand = expand_of_m_tile(a.m_tile);  // the FC2 kernel's A layout
  for (int row0 = 2 * blockIdx.y; row0 < w.rows; row0 += 2 * gridDim.y) {  // whole warps step together
    const int row = row0 + half;
    const bool live = row < w.rows;
    const int slot = w.start + (live ? row : row0);
    const float* part = static_cast<const float*>(a.partial) + size_t(slot) * 2 * inter + col;
    float g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, u[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int s = 0; s < a.k_split; ++s) {
      const float* p = part + s * split_stride;
      const float4 g0 = *reinterpret_cast<const float4*>(p), g1 = *reinterpret_cast<const float4*>(p + 4);
      const float4 u0 = *reinterpret_cast<const float4*>(p + inter), u1 = *reinterpret_cast<const float4*>(p + inter + 4);
      g[0] += g0.x; g[1] += g0.y; g[2] += g0.z; g[3] += g0.w; g[4] += g1.x; g[5] += g1.y; g[6] += g1.z; g[7] += g1.w;
      u[0] += u0.x; u[1] += u0.y; u[2] += u0.z; u[3] += u0.w; u[4] += u1.x; u[5] += u1.y; u[6] += u1.z; u[7] += u1.w;
    }
    hadamard128_unscaled<16>(g, lane);
    hadamard128_unscaled<16>(u, lane);
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float gate = g[i] * svh_g[i];
      const float up = u[i] * svh_u[i];
      v[i] = gate / (1.0f + expf(-gate)) * up * suh_d[i];
    }
    hadamard128_unscaled<16>(v, lane);
    if (live) store_a_row8(static_cast<__half*>(a.act) + size_t(slot) * expand * inter, col, expand, v);
  }
}

__device__ __forceinline__ void store_out(const TrellisMoeArgs& a, size_t idx, float4 v) {
  if (a.out_dtype == TRELLIS_DT_FP32) {
    *reinterpret_cast<float4*>(static_cast<float*>(a.out) + idx) = v;
  } else if (a.out_dtype == TRELLIS_DT_FP16) {
    __half2 h0 = __floats2half2_rn(v.x, v.y), h1 = __floats2half2_rn(v.z, v.w);
    uint2 raw = make_uint2(*reinterpret_cast<uint32_t*>(&h0), *reinterpret_cast<uint32_t*>(&h1));
    *reinterpret_cast<uint2*>(static_cast<__half*>(a.out) + idx) = raw;
  } else {
    __nv_bfloat162 h0 = __floats2bfloat162_rn(v.x, v.y), h1 = __floats2bfloat162_rn(v.z, v.w);
    uint2 raw = make_uint2(*reinterpret_cast<uint32_t*>(&h0), *reinterpret_cast<uint32_t*>(&h1));
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + idx) = raw;
  }
}

constexpr int kSumThreads = 256;

// grid (M, ceil(H / (4 * kSumThreads))): each thread sums 4 columns of one token.
__global__ void __launch_bounds__(kSumThreads) topk_sum_kernel(const TrellisMoeArgs a) {
  const int token = blockIdx.x;
  const int col = (blockIdx.y * kSumThreads + threadIdx.x) * 4;
  // Which routes this rank serves depends on the layer inputs only: look it up while FC2 drains.
  uint32_t served = 0;
  for (int k = 0; k < a.top_k && k < 32; ++k)
    if (route_combined(a, token * a.top_k + k) >= 0) served |= 1u << k;
  after_predecessor();
  if (col >= a.hidden) return;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int k = 0; k < a.top_k; ++k) {
    const int route = token * a.top_k + k;
    if (k < 32 ? !((served >> k) & 1u) : route_combined(a, route) < 0) continue;
    const float4 y = *reinterpret_cast<const float4*>(static_cast<const float*>(a.route_out) + size_t(route) * a.hidden + col);
    acc.x += y.x;
    acc.y += y.y;
    acc.z += y.z;
    acc.w += y.w;
  }
  store_out(a, size_t(token) * a.hidden + col, acc);
}

}  // namespace trellis
