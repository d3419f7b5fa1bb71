// Kernel launch with programmatic dependent launch (PDL): the host side of warp_ops.cuh's
// allow_dependents / after_predecessor. Shared by trellis_moe.cu and the probes.
#pragma once
#include <cuda_runtime.h>

namespace trellis {

// Launches kernel<<<grid, block, smem, stream>>>(args...); with `pdl` it may start while the kernel before
// it in the stream drains (sm_90; the kernel must wait before reading what its predecessor wrote).
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream, bool pdl,
                   const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace trellis
