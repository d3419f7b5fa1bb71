// The activation between FC1 and FC2, and the fixed-order top-k sum.
//
// activation: per route, add the FC1 partial sums of every H range in order (fc1_split.cuh), rotate gate
// and up back (H128, svh), SiLU(gate) * up, then rotate into FC2's input basis (suh of down, H128) and
// store fp16.
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

__device__ __forceinline__ void add4(float* v, float4 d) {
  v[0] += d.x;
  v[1] += d.y;
  v[2] += d.z;
  v[3] += d.w;
}

constexpr int kSplitBatch = 8;
// Warps per CTA: one per 128-channel block of the intermediate dim, up to this many; grid.z covers the rest.
// A CTA per whole intermediate dim (I/128 warps) could not launch from I = 2048 on: 32 warps of 72
// registers, or 16 of 210, exceed an SM's 64 K registers.
constexpr int kActWarps = 4;

// grid (tile_capacity, activation_row_steps, ceil(I/128 / kActWarps)), one warp per 128-channel block of the
// intermediate dim; each half warp takes one route row per step (8 channels per lane, as the input
// rotation of small tiles: the kernel is issue-bound).
//
// At small M (FC1 split k) this kernel sits on the call's critical path between FC1 and FC2 with about
// one row per route, so its time is latency: kBatch > 1 loads the partial sums of that many k ranges
// before adding the first (one L2 round trip per batch), and kWarmPass runs the row code once before the
// wait on FC1, on the vectors already loaded, so its instructions are fetched while FC1 still runs
// (together -6 % at M=1, the warm pass 0.7 us of it). At large M both would cost occupancy (72 registers become 210).
template <int kBatch, bool kWarmPass>
__global__ void __launch_bounds__(kActWarps * 32, kBatch == 1 ? 7 : 1)
    activation_kernel(const TrellisMoeArgs a, const Fc1Pieces pieces) {
  WorkTile w;
  if (!load_work_tile(a, blockIdx.x, w)) return;
  const int lane = threadIdx.x & 15, half = (threadIdx.x >> 4) & 1;
  const int block = blockIdx.z * kActWarps + (threadIdx.x >> 5);
  if (block >= a.intermediate >> 7) return;  // whole warps
  const int inter = a.intermediate;
  const int col = block * 128 + 8 * lane;
  const __half* rot = static_cast<const __half*>(a.rot_intermediate) + size_t(w.expert) * 3 * inter;
  // Layer inputs, read while FC1 drains. Each H128 is unscaled: its 1/sqrt(128) rides on the vector
  // that multiplies its result.
  float svh_g[8], svh_u[8], suh_d[8];
  load8_rotation_scaled(rot + col, svh_g);
  load8_rotation_scaled(rot + inter + col, svh_u);
  load8_rotation_scaled(rot + 2 * inter + col, suh_d);
  const size_t split_stride = size_t(a.slot_capacity) * 2 * inter;
  const int expand = expand_of_m_tile(a.m_tile);  // the FC2 kernel's A layout
  // Pass 0 fetches the instructions (its results are dropped); pass 1 computes the rows.
  int planes = 0;  // FC1's partial-sum planes of this tile
#pragma unroll 1
  for (int pass = kWarmPass ? 0 : 1; pass < 2; ++pass) {
    if (pass == 1) {
      planes = fc1_tile_planes(a, pieces, blockIdx.x);
      if (tile_handover(a)) {  // wait for this tile's FC1 pieces only (handover.cuh), if the CTA has rows
        allow_dependents();
        if (2 * int(blockIdx.y) < w.rows)
          wait_count<true>(handover(a).fc1_done + blockIdx.x, fc1_items_per_tile(a) * planes);
      } else {
        after_predecessor();
      }
    }
    const int rows_end = pass ? w.rows : min(w.rows, 2 * blockIdx.y + 1);
    for (int row0 = 2 * blockIdx.y; row0 < rows_end; row0 += 2 * gridDim.y) {  // whole warps step together
      const int row = row0 + half;
      const bool live = row < w.rows;
      const int slot = w.start + (live ? row : row0);
      const float* part = static_cast<const float*>(a.partial) + size_t(slot) * 2 * inter + col;
      float g[8], u[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        g[i] = pass ? 0.f : svh_g[i];
        u[i] = pass ? 0.f : svh_u[i];
      }
      const int splits = pass ? planes : 0;
#pragma unroll(kBatch == 1 ? 2 : 1)
      for (int s0 = 0; s0 < splits; s0 += kBatch) {
        float4 pg[kBatch][2], pu[kBatch][2];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (s0 + j < splits) {
            const float* p = part + (s0 + j) * split_stride;
            pg[j][0] = *reinterpret_cast<const float4*>(p);
            pg[j][1] = *reinterpret_cast<const float4*>(p + 4);
            pu[j][0] = *reinterpret_cast<const float4*>(p + inter);
            pu[j][1] = *reinterpret_cast<const float4*>(p + inter + 4);
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {  // summed in range order
          if (s0 + j < splits) {
            add4(g, pg[j][0]);
            add4(g + 4, pg[j][1]);
            add4(u, pu[j][0]);
            add4(u + 4, pu[j][1]);
          }
        }
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
      if (pass && live) store_a_row8(static_cast<__half*>(a.act) + size_t(slot) * expand * inter, col, expand, v);
    }
  }
  if (tile_handover(a)) {  // this warp's block of its rows of the tile is stored
    __syncwarp();
    if ((threadIdx.x & 31) == 0) count_done(handover(a).act_done + blockIdx.x);
  }
}

// The activation kernel for this call's k ranges.
inline void (*activation_for(const TrellisMoeArgs& a))(TrellisMoeArgs, Fc1Pieces) {
  return a.k_split > 1 ? activation_kernel<kSplitBatch, true> : activation_kernel<1, false>;
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

// grid (M, ceil(H / (4 * kSumThreads))): each thread sums 4 columns of one token. kBatch routes' rows are
// loaded before the first is added: 8 at small M, where the kernel is one round trip on the critical path;
// 4 at large M, where it streams the route rows: 40 registers (6 CTAs per SM) with 4 loads in flight per
// thread beat both 72 registers with 8 (3 CTAs) and 36 with 1 (M=3072: 2059 / 2097 / 2106 us per call).
template <int kBatch>
__global__ void __launch_bounds__(kSumThreads) topk_sum_kernel(const TrellisMoeArgs a) {
  const int token = blockIdx.x;
  const int col = (blockIdx.y * kSumThreads + threadIdx.x) * 4;
  // Which routes this rank serves depends on the layer inputs only: look it up while FC2 drains.
  const uint32_t served = served_mask(a, token * a.top_k, min(a.top_k, 32));
  // Shared-H packs: FC2 left the route rows unrotated (expert_gemm.cuh store_down_rows), and the sum
  // applies H128 and the one svh row. Warps hold whole 128-column blocks (H is a multiple of 128).
  const bool rotate = a.down_svh_shared && col < a.hidden;
  float svh[4];
  if (rotate) load4_half(static_cast<const __half*>(a.down_svh) + col, svh);
  after_predecessor();
  if (col >= a.hidden) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const float* rows = static_cast<const float*>(a.route_out) + size_t(token) * a.top_k * a.hidden + col;
  for (int k0 = 0; k0 < a.top_k; k0 += kBatch) {
    float4 y[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int k = k0 + j;
      if (k < a.top_k && (k < 32 ? (served >> k) & 1u : route_combined(a, token * a.top_k + k) >= 0))
        y[j] = *reinterpret_cast<const float4*>(rows + size_t(k) * a.hidden);
      else
        y[j] = make_float4(0.f, 0.f, 0.f, 0.f);  // not served here: contributes exactly zero
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) add4(acc, y[j]);  // in route order
  }
  if (rotate) {
    hadamard128(acc, threadIdx.x & 31);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] *= svh[i];
  }
  store_out(a, size_t(token) * a.hidden + col, make_float4(acc[0], acc[1], acc[2], acc[3]));
}

// The top-k sum kernel for this call's M.
inline void (*topk_sum_for(const TrellisMoeArgs& a))(TrellisMoeArgs) {
  return a.m <= 64 ? topk_sum_kernel<8> : topk_sum_kernel<4>;
}

}  // namespace trellis
