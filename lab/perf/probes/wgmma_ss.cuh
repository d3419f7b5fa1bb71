// d += A * B with A (64 x 16) and B (16 x N) both read from shared memory through descriptors: the probes'
// shared-memory-sourced wgmma (the kernels take A from registers, wgmma.cuh).
#pragma once
#include <stdint.h>

#include "../../../kernels/wgmma.cuh"

#ifdef TRELLIS_DEVICE_WGMMA
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc);
#define PROBE_WGMMA_SS(N, NAMES, ADESC, BDESC, PRED, ...)                                                     \
  template <>                                                                                               \
  __device__ __forceinline__ void wgmma_ss<N>(float(&d)[64], uint64_t a_desc, uint64_t b_desc) {           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PRED ", 0;\n"                                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" NAMES "}, %" #ADESC ", %" #BDESC \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                    \
                 : __VA_ARGS__                                                                                \
                 : "l"(a_desc), "l"(b_desc), "r"(1));                                                         \
  }
PROBE_WGMMA_SS(32, TRELLIS_ACC_NAMES_0, 16, 17, 18, TRELLIS_ACC16(0))
PROBE_WGMMA_SS(64, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16, 32, 33, 34, TRELLIS_ACC16(0), TRELLIS_ACC16(16))
PROBE_WGMMA_SS(96, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16 TRELLIS_ACC_NAMES_32, 48, 49, 50, TRELLIS_ACC16(0),
               TRELLIS_ACC16(16), TRELLIS_ACC16(32))
PROBE_WGMMA_SS(128, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16 TRELLIS_ACC_NAMES_32 TRELLIS_ACC_NAMES_48, 64, 65, 66,
               TRELLIS_ACC16(0), TRELLIS_ACC16(16), TRELLIS_ACC16(32), TRELLIS_ACC16(48))
#undef PROBE_WGMMA_SS
#endif
