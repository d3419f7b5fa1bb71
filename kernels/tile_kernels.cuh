// Which GEMM kernels serve a call's work tiles: decided from the arguments alone, so that the host (which
// launches them) and the device (whose hand-over depends on them, handover.cuh) agree.
#pragma once
#include "abi.h"

namespace trellis {

// Features per FC1 item on wgmma (expert_wgmma.cuh kWgFeatures).
constexpr int kFc1WgmmaFeatures = 256;

// Whether FC1 and FC2 of this call run on the wgmma kernels (trellis_moe.cu tile_family, gemm_unit.cu).
__host__ __device__ __forceinline__ bool gemms_on_wgmma(const TrellisMoeArgs& a) {
#ifdef TRELLIS_WGMMA
  return a.m_tile == 128 && a.hidden % kFc1WgmmaFeatures == 0 && a.intermediate % kFc1WgmmaFeatures == 0;
#else
  return false;
#endif
}

// Every served tier is K3 or K4: the kernels instantiated for those two alone (FAST) serve the call.
__host__ __device__ __forceinline__ bool only_k3_k4(const TrellisMoeArgs& a) {
  for (int t = 0; t < a.num_tiers; ++t)
    if (a.tier_size[t] > 0 && a.tier_k[t] != 3 && a.tier_k[t] != 4) return false;
  return true;
}

// K3/K4 layers whose experts average fewer routes than this (M * top_k / E) run the narrow wgmma kernels:
// passes of 64 routes, two CTAs per SM, handing over by tile (glm52-tp4 on H200, against the wide
// kernels: M = 352-1024 −7 to −11 %, M = 1280 and 1536 −6 to −9 %, M=1792 +3 %). A
// tile of more routes takes one pass per 64, decoding its weights again, which few tiles need below this
// mean.
constexpr int kNarrowBelowRoutes = 52;
__host__ __device__ __forceinline__ bool narrow_wgmma_tiles(const TrellisMoeArgs& a) {
  if (!gemms_on_wgmma(a)) return false;
  const bool narrow = 1LL * a.m * a.top_k < 1LL * kNarrowBelowRoutes * (a.num_experts > 1 ? a.num_experts : 1);
  return narrow && only_k3_k4(a);
}

}  // namespace trellis
