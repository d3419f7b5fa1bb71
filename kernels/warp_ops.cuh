// Warp-level building blocks: tensor-core MMA, ldmatrix, and the 128-point Hadamard rotation.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace trellis {

// D += A(16x16, row) * B(16x8, col), fp16 operands, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 fp16 matrices from shared memory (ldmatrix .x4): lanes 8q..8q+7 name the 8 rows of matrix q,
// and lane l receives, of each matrix, row l / 4 at columns 2 (l % 4) and 2 (l % 4) + 1. Matrices at
// constant offsets from the lane's address are that many bytes away, which folds into the immediate.
__device__ __forceinline__ void ldmatrix_x4(uint32_t m[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
               : "r"(addr));
}

constexpr float kHadamardScale = 0.08838834764831845f;  // 1/sqrt(128)

// 128-point Sylvester Hadamard / sqrt(128) across a warp: lane l holds elements 4l..4l+3. Each butterfly
// across lanes is one FFMA by +-1 (exact, like the add or subtract it replaces, which took an add, a
// subtract and a select).
__device__ __forceinline__ void hadamard128(float v[4], int lane) {
  const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
  v[0] = a0 + a2;
  v[1] = a1 + a3;
  v[2] = a0 - a2;
  v[3] = a1 - a3;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const float sign = (lane & m) ? -1.0f : 1.0f;  // the upper lane of a pair keeps partner - own
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = fmaf(v[i], sign, __shfl_xor_sync(0xFFFFFFFFu, v[i], m));
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= kHadamardScale;
}

// The same rotation, unscaled, across each half warp: lane l (0..15 of its half) holds elements
// 8l..8l+7 of its half's row. Three butterfly stages stay in registers and four cross lanes, so a warp
// rotates two rows with 16 shuffles per row instead of 20 for one; each butterfly is one FFMA by +-1
// (exact, like the add or subtract it replaces).
__device__ __forceinline__ void hadamard128_unscaled_half(float v[8], int lane) {
#pragma unroll
  for (int s = 1; s < 8; s <<= 1)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (!(i & s)) {
        const float lo = v[i], hi = v[i + s];
        v[i] = lo + hi;
        v[i + s] = lo - hi;
      }
#pragma unroll
  for (int m = 1; m < 16; m <<= 1) {
    const float sign = (lane & m) ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = fmaf(v[i], sign, __shfl_xor_sync(0xFFFFFFFFu, v[i], m));
  }
}

// Programmatic dependent launch (sm_90): a kernel launched with the programmatic-serialization attribute
// may start while its predecessor drains; it must wait before reading what the predecessor wrote, and it
// lets its own dependents start only after that wait (so every earlier kernel of the call has finished).
__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}
__device__ __forceinline__ void after_predecessor() {
  wait_for_predecessor();
  allow_dependents();
}

__device__ __forceinline__ float to_float(__half h) { return __half2float(h); }

// fp32 -> fp16 with saturation: an outlier must not become inf in an MMA operand.
__device__ __forceinline__ __half to_half_sat(float f) {
  return __float2half_rn(fminf(fmaxf(f, -65504.0f), 65504.0f));
}

}  // namespace trellis
