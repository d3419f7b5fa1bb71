// Host side of the input rotation (expert_gemm.cuh rotate_input_kernel, rotate_routes_kernel): which
// kernel and grid a call takes. A non-template inline function instantiates every kernel it names in any
// translation unit that includes it, so only the host unit (trellis_moe.cu) includes this file.
#pragma once
#include "abi.h"
#include "expert_gemm.cuh"

namespace trellis {

// The rotation kernel and grid for this call's tiles and input dtype.
struct RotationLaunch {
  void (*kernel)(TrellisMoeArgs);
  dim3 grid;
};
inline RotationLaunch rotation_for(const TrellisMoeArgs& a, int tiles) {
  const bool bf16 = a.x_dtype == TRELLIS_DT_BF16;
  if (!route_rows(a.m_tile, a.direct) && !rows_by_token(a)) {  // the rows FC1 reads per slot (fc1_body), plain columns
    // Column blocks per CTA so that a tile's expected rows (routes per expert: plan.py routes_per_expert)
    // times blocks fill the CTA's 32 (row, block) items per step.
    const int experts = a.num_experts > 1 ? a.num_experts : 1;
    const long long rows = (1LL * a.m * a.top_k + experts - 1) / experts;
    int blocks = rows >= 32 ? 1 : rows >= 16 ? 2 : kMaxRotateBlocks;
    while ((a.hidden / 128) % blocks) blocks >>= 1;
    return {bf16 ? rotate_input_kernel<true> : rotate_input_kernel<false>, dim3(tiles, a.hidden / 128 / blocks)};
  }
  const int steps = (a.hidden / 128 + kSmallRotateBlocks - 1) / kSmallRotateBlocks;
  return {bf16 ? rotate_routes_kernel<true> : rotate_routes_kernel<false>,
          dim3(rows_by_token(a) ? a.m : a.m * a.top_k, steps)};
}

}  // namespace trellis
