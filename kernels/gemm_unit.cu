// One GEMM unit of the kernel library (gemm_table.h): the FC1 and FC2 kernels of codebook
// TRELLIS_UNIT_CODEBOOK and tile family TRELLIS_UNIT_FAMILY (a trellis::TileFamily), for the K-sets in
// the bit mask TRELLIS_UNIT_KSETS (1 << trellis::KSet; default both), with their launch shapes.
// trellis_cli/kernel/build.py compiles this file once per unit. Without TRELLIS_UNIT_FAMILY it holds every
// family of the codebook.
#include <math.h>

#include <algorithm>

#include "abi.h"
#include "expert_gemm.cuh"
#include "expert_wgmma.cuh"
#include "gemm_table.h"
#include "occupancy.cuh"

#ifndef TRELLIS_UNIT_CODEBOOK
#error "TRELLIS_UNIT_CODEBOOK must name the codebook id this unit serves"
#endif
#ifndef TRELLIS_UNIT_KSETS
#define TRELLIS_UNIT_KSETS 3
#endif

namespace trellis {

// FC2's output blocks per CTA for small tiles (expert_gemm.cuh, fc2_body): the most, up to 4, that still
// leave kFc2SpanWaves waves of CTAs on the GPU, counting the tiles that uniform routing would fill (the
// tile capacity is far above them at small M); 1 in direct mode (one wave). A span needs I/128 to be a power
// of two and a multiple of the ring's stages. Only the launch shape depends on it, never a result.
// 4 blocks per CTA saved 1-3 % of the call at M = 64-256.
inline constexpr int kFc2SpanWaves = 4, kFc2MaxSpan = 4;  // inline: no unused warning in units without fc2_span
template <int R, bool FAST>
int fc2_span(const TrellisMoeArgs& a, void (*kernel)(TrellisMoeArgs)) {
  const int block_chunks = a.intermediate / 128, blocks = a.hidden / 128;
  if (a.direct || !trellis::small_tile(R) || block_chunks % trellis::fc2_stages(R, FAST) != 0 ||
      (block_chunks & (block_chunks - 1)) != 0)
    return 1;
  SmLimits l;
  if (!sm_limits(l)) return 1;
  const int slots = l.sms * ctas_per_sm(kernel, trellis::kFc2Threads, trellis::fc2_smem_bytes(R, FAST));
  const double routes = double(a.m) * a.top_k, experts = a.num_experts > 0 ? a.num_experts : 1;
  const double touched = a.num_combined * (1.0 - pow(1.0 - 1.0 / experts, routes));
  const double tiles = std::min(touched + routes * a.num_combined / experts / a.m_tile, double(a.tile_capacity));
  int span = kFc2MaxSpan;
  while (span > 1 && (blocks % span != 0 || tiles * blocks / span < double(kFc2SpanWaves) * slots)) span /= 2;
  return span;
}

template <int CB, int R, bool FAST>
GemmKernels mma_sync_kernels(const TrellisMoeArgs& a) {
  using namespace trellis;
  const int span = fc2_span<R, FAST>(a, fc2_kernel<CB, R, FAST>);
  return {fc1_kernel<CB, R, FAST>, fc2_kernel<CB, R, FAST>, kFc1Threads, fc1_smem_bytes(R, FAST),
          dim3(a.tile_capacity, a.hidden / 128 / span), kFc2Threads, fc2_smem_bytes(R, FAST)};
}

#ifdef TRELLIS_WGMMA  // sm_90a build: large tiles run on wgmma (expert_wgmma.cuh)

template <int CB, bool FAST>
GemmKernels wgmma_kernels(const TrellisMoeArgs& a) {
  using namespace trellis;
  const dim3 fc2_grid(a.tile_capacity * fc2_wgmma_groups(a.hidden));
  if constexpr (FAST) {
    if (narrow_wgmma_tiles(a)) {  // tile_kernels.cuh
      constexpr int kSmem = wg_smem_bytes(true, kWgNarrowRows);
      return {fc1_wgmma_kernel<CB, true, kWgNarrowRows>, fc2_wgmma_kernel<CB, true, kWgNarrowRows>, kWgThreads,
              kSmem, fc2_grid, kWgThreads, kSmem};
    }
  }
  return {fc1_wgmma_kernel<CB, FAST, kWgRows>, fc2_wgmma_kernel<CB, FAST, kWgRows>, kWgThreads,
          wg_smem_bytes(FAST, kWgRows), fc2_grid, kWgThreads, wg_smem_bytes(FAST, kWgRows)};
}
#endif

template <int CB, int FAMILY, bool FAST>
GemmKernels gemm_kernels(const TrellisMoeArgs& a) {
  if constexpr (FAMILY == kMma16) {
    return mma_sync_kernels<CB, 1, FAST>(a);
  } else if constexpr (FAMILY == kMma32) {
    return mma_sync_kernels<CB, 2, FAST>(a);
  } else if constexpr (FAMILY == kMma128) {
    return mma_sync_kernels<CB, 8, FAST>(a);
  } else {
#ifdef TRELLIS_WGMMA
    static_assert(FAMILY == kWgmma, "unknown tile family");
    return wgmma_kernels<CB, FAST>(a);
#else
    static_assert(FAMILY != FAMILY, "the wgmma family needs an sm_90a build (-DTRELLIS_WGMMA)");
#endif
  }
}

namespace {

// Fills this unit's entries of the table when the library is loaded.
template <int CB, int FAMILY, int KSETS>
struct RegisterFamily {
  static_assert(CB >= 0 && CB < kCodebooks && FAMILY >= 0 && FAMILY < kTileFamilies, "bad unit");
  RegisterFamily() {
    if constexpr ((KSETS >> kAllK) & 1) g_gemm_kernels[CB][FAMILY][kAllK] = &gemm_kernels<CB, FAMILY, false>;
    if constexpr ((KSETS >> kOnlyK3K4) & 1) g_gemm_kernels[CB][FAMILY][kOnlyK3K4] = &gemm_kernels<CB, FAMILY, true>;
  }
};

#ifdef TRELLIS_UNIT_FAMILY
const RegisterFamily<TRELLIS_UNIT_CODEBOOK, TRELLIS_UNIT_FAMILY, TRELLIS_UNIT_KSETS> registered;
#else
const RegisterFamily<TRELLIS_UNIT_CODEBOOK, kMma16, TRELLIS_UNIT_KSETS> registered_mma16;
const RegisterFamily<TRELLIS_UNIT_CODEBOOK, kMma32, TRELLIS_UNIT_KSETS> registered_mma32;
const RegisterFamily<TRELLIS_UNIT_CODEBOOK, kMma128, TRELLIS_UNIT_KSETS> registered_mma128;
#ifdef TRELLIS_WGMMA
const RegisterFamily<TRELLIS_UNIT_CODEBOOK, kWgmma, TRELLIS_UNIT_KSETS> registered_wgmma;
#endif
#endif

}  // namespace
}  // namespace trellis
