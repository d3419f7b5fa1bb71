// The work tiles of the FC1 and FC2 kernels (expert_gemm.cuh): their sizes and row layouts, a tile's
// expert and routes, and the loads and the one-block input rotation the kernels share.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "abi.h"
#include "decode.cuh"
#include "route_pack.cuh"
#include "tile_kernels.cuh"
#include "warp_ops.cuh"

namespace trellis {

// Work tiles of R m16 blocks: R = 1 and 2 (16 and 32 rows, small and mid M) multiply split codebook words
// (decode.cuh) against activations stored with every column twice (expanded_col) and stream their copies;
// R = 8 (128 rows, large M) keeps the merged fp16 weight, plain rows and register-lean copies.
__host__ __device__ constexpr bool small_tile(int r) { return r <= 2; }
__host__ __device__ constexpr int a_expand(int r) { return small_tile(r) ? 2 : 1; }
__host__ __device__ constexpr int expand_of_m_tile(int m_tile) { return m_tile <= 32 ? 2 : 1; }
// 16- and 32-row tiles keep FC1's rotated input rows per route, not per slot (rotate_routes_kernel), so
// the rotation needs no tile list and runs beside the route pack instead of after it.
__host__ __device__ constexpr bool route_rows(int m_tile, bool direct) { return m_tile <= 32 && !direct; }
// Shared-H packs (one gate and one up suh row for every expert): all routes of a token have the same
// rotated input, so the rotation runs once per token and FC1 reads row `route / top_k`, wherever it gathers
// its rows by index anyway: route rows, and the wgmma 128-row tiles (expert_wgmma.cuh). A top_k-th of the
// rotation's work and writes (glm52-tp4 M=3072: 578 MB of rotated rows per call otherwise).
__host__ __device__ __forceinline__ bool rows_by_token(const TrellisMoeArgs& a) {
  return a.gate_suh_shared && a.up_suh_shared && (route_rows(a.m_tile, a.direct) || gemms_on_wgmma(a));
}
// The token of the route in `slot`. route / top_k is a shift for the usual power-of-two top_k
// (an integer division costs ~20 instructions).
__device__ __forceinline__ size_t slot_token(const TrellisMoeArgs& a, int slot) {
  const int route = static_cast<const int*>(a.slot_route)[slot];
  return (a.top_k & (a.top_k - 1)) ? route / a.top_k : route >> (__ffs(a.top_k) - 1);
}
// Halves per staged row: a chunk's 16 * kt columns (kt k tiles of 16; twice that expanded) + 8 of padding
// keeps ldmatrix conflict-free. FC2 and most FC1 kernels stage 128-column chunks (kt = 8).
__host__ __device__ constexpr int a_stride(int r, int kt = 8) { return 16 * kt * a_expand(r) + 8; }
// k tiles per chunk that FC1 and FC2 stage. Builds without wgmma (sm_80, sm_100, sm_12x) also serve GPUs with
// 99 KB of shared memory per block, where a 128-column chunk of 128 rows (FC1: 168 KB in two stages) or of the
// all-K kernels' words (FC1: 130 KB or more) does not fit: their all-K 16- and 32-row FC1 and their K3/K4
// 128-row FC1 stage 64 columns at a time (96.5, 66 and 88 KB), the all-K 128-row FC1 32 (57 KB) and its FC2
// 64 (79 KB). A chunk of the plan (fc1_split.cuh, FC2's blocks) is still 128 columns: these kernels walk it
// in pieces.
// The compact 128-row kernels (builds without wgmma): k tiles per staged chunk and stages of the ring, of
// FC1 and FC2, for the K3/K4 (FAST) and the all-K kernels.
struct CompactStaging {
  int fc1_kt, fc1_stages, fc2_kt, fc2_stages;
};
__host__ __device__ constexpr CompactStaging compact_staging(bool fast) {
  return fast ? CompactStaging{4, 2, 8, 2} : CompactStaging{2, 2, 4, 3};  // K3/K4 : all K
}
__host__ __device__ constexpr int fc1_chunk_tiles(int r, bool fast) {
#ifdef TRELLIS_WGMMA
  return (void)r, (void)fast, 8;
#else
  return r > 2 ? compact_staging(fast).fc1_kt : (fast ? 8 : 4);
#endif
}
__host__ __device__ constexpr int fc2_chunk_tiles(int r, bool fast) {
#ifdef TRELLIS_WGMMA
  return (void)r, (void)fast, 8;
#else
  return r > 2 ? compact_staging(fast).fc2_kt : 8;
#endif
}
constexpr int kOStride = 132;  // floats per epilogue row
constexpr int kFc1Threads = 512;
constexpr int kFc2Threads = 256;

struct WorkTile {
  int expert, start, rows, tier, local, k;
};

// Direct mode reads the layer inputs only, so a kernel may call it before its predecessor finishes.
__device__ __forceinline__ bool load_work_tile(const TrellisMoeArgs& a, int tile, WorkTile& w) {
  if (a.direct) {
    if (tile >= a.m * a.top_k || (w.expert = route_combined(a, tile)) < 0) return false;
    w.start = tile;
    w.rows = 1;
  } else {
    if (tile >= *static_cast<const int*>(a.tile_count)) return false;
    w.expert = static_cast<const int*>(a.tile_expert)[tile];
    w.start = static_cast<const int*>(a.tile_start)[tile];
    w.rows = static_cast<const int*>(a.tile_rows)[tile];
  }
  const int d = static_cast<const int*>(a.descriptors)[w.expert];
  w.tier = d >> 8;
  w.local = d & 0xFF;
  w.k = a.tier_k[w.tier];
  return true;
}

// The route computed in slot `slot`.
__device__ __forceinline__ int slot_route_of(const TrellisMoeArgs& a, int slot) {
  return a.direct ? slot : static_cast<const int*>(a.slot_route)[slot];
}

// Words of projection `proj` of the tile's expert (tier layout [E_t, 3, tiles, 16K] int16).
template <int K>
__device__ __forceinline__ const uint32_t* projection_words(const TrellisMoeArgs& a, const WorkTile& w, int proj) {
  const size_t tiles = size_t(a.hidden >> 4) * size_t(a.intermediate >> 4);
  return static_cast<const uint32_t*>(a.tier_trellis[w.tier]) + (size_t(w.local) * 3 + proj) * tiles * (8 * K);
}

__device__ __forceinline__ void load4_half(const __half* p, float v[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __half2 p0 = *reinterpret_cast<const __half2*>(&raw.x);
  const __half2 p1 = *reinterpret_cast<const __half2*>(&raw.y);
  v[0] = __low2float(p0);
  v[1] = __high2float(p0);
  v[2] = __low2float(p1);
  v[3] = __high2float(p1);
}

// Eight consecutive fp16 or bf16 values (16 bytes) as floats.
__device__ __forceinline__ void load8(bool bf16, const void* p, float v[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (bf16) {
      const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&words[i]);
      v[2 * i] = __low2float(b);
      v[2 * i + 1] = __high2float(b);
    } else {
      const __half2 h = *reinterpret_cast<const __half2*>(&words[i]);
      v[2 * i] = __low2float(h);
      v[2 * i + 1] = __high2float(h);
    }
  }
}

// Eight fp16 values times 1/sqrt(128): the vectors that carry an unscaled H128's scale (suh, svh).
__device__ __forceinline__ void load8_rotation_scaled(const __half* p, float v[8]) {
  load8(false, p, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] *= kHadamardScale;
}

// Eight floats as fp16 (saturated) into the 16 bytes at p.
__device__ __forceinline__ void store8_half(__half* p, const float v[8]) {
  *reinterpret_cast<uint4*>(p) = make_uint4(to_half2_sat(v[0], v[1]), to_half2_sat(v[2], v[3]),
                                            to_half2_sat(v[4], v[5]), to_half2_sat(v[6], v[7]));
}

// Columns col..col+7 (col % 8 == 0) of an A row: plain (expand 1) or with every column twice (expand 2).
__device__ __forceinline__ void store_a_row8(__half* row, int col, int expand, const float v[8]) {
  if (expand == 1) {
    store8_half(row + col, v);
    return;
  }
  const float even[8] = {v[0], v[0], v[2], v[2], v[4], v[4], v[6], v[6]};
  const float odd[8] = {v[1], v[1], v[3], v[3], v[5], v[5], v[7], v[7]};
  store8_half(row + expanded_col(col), even);
  store8_half(row + expanded_col(col + 1), odd);
}

// The suh row of FC1 projection p (0 gate, 1 up) for `expert`, or the layer's one shared row.
__device__ __forceinline__ const __half* input_suh(const TrellisMoeArgs& a, int expert, int p) {
  const bool shared = p ? a.up_suh_shared : a.gate_suh_shared;
  return static_cast<const __half*>(p ? a.up_suh : a.gate_suh) + size_t(shared ? 0 : expert) * a.hidden;
}

// H128(x ⊙ s) of one 128-column block across a half warp: lane l (0..15) holds columns 8l..8l+7 of x and
// of s, with s already scaled by 1/sqrt(128) (input_suh8). Every lane of the warp must call it.
__device__ __forceinline__ void rotate8(const float x[8], const float s[8], int lane, float v[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = x[i] * s[i];
  hadamard128_unscaled<16>(v, lane);
}

// Columns col..col+7 of suh row p for `expert`, times 1/sqrt(128): the rotation's scale rides on it.
__device__ __forceinline__ void input_suh8(const TrellisMoeArgs& a, int expert, int p, int col, float s[8]) {
  load8_rotation_scaled(input_suh(a, expert, p) + col, s);
}

// Columns col..col+7 of token `token`'s input row (bf16 when `bf16`, else fp16) as floats. A kernel that
// converts many rows takes `bf16` as a template argument: a run-time flag makes the compiler issue both
// conversions, one of them predicated off, which still costs issue slots.
__device__ __forceinline__ void load_x8(const TrellisMoeArgs& a, bool bf16, size_t token, int col, float x[8]) {
  load8(bf16, static_cast<const char*>(a.x) + (token * a.hidden + col) * 2, x);
}

}  // namespace trellis
