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

// 128-point Sylvester Hadamard, unscaled, across each group of G aligned lanes (G = 4, 16 or 32): lane q
// of its group holds the 128/G elements R G j + R q + i, in runs j of R = min(8, 128/G) consecutive
// elements i, so a group's 16-byte loads and stores cover R G contiguous elements each. The index bits
// below R are butterflies in registers, the next log2(G) bits cross lanes (one FFMA by +-1 each: exact,
// like the add or subtract it replaces, which took an add, a subtract and a select), the rest are in
// registers again. The stages run from the lowest index bit up for every G, so every G gives the same
// bits; fewer lanes per row take fewer shuffles per element (G = 4: 2, G = 16: 4, G = 32: 5).
template <int G>
__device__ __forceinline__ void hadamard128_unscaled(float v[128 / G], int lane) {
  constexpr int N = 128 / G, R = N < 8 ? N : 8;
  auto in_registers = [&](int s) {  // the stage of index bit log2(s), s < N
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (!(i & s)) {
        const float lo = v[i], hi = v[i + s];
        v[i] = lo + hi;
        v[i + s] = lo - hi;
      }
  };
#pragma unroll
  for (int s = 1; s < R; s <<= 1) in_registers(s);
#pragma unroll
  for (int m = 1; m < G; m <<= 1) {
    const float sign = (lane & m) ? -1.0f : 1.0f;  // the upper lane of a pair keeps partner - own
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = fmaf(v[i], sign, __shfl_xor_sync(0xFFFFFFFFu, v[i], m));
  }
#pragma unroll
  for (int s = R; s < N; s <<= 1) in_registers(s);
}

// The same rotation / sqrt(128) across a warp: lane l holds elements 4l..4l+3 (FC2's epilogue rows).
__device__ __forceinline__ void hadamard128(float v[4], int lane) {
  hadamard128_unscaled<32>(v, lane);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= kHadamardScale;
}

// Programmatic dependent launch (sm_90): a kernel launched with the programmatic-serialization attribute
// may start while its predecessor drains; it must wait before reading what the predecessor wrote, and it
// lets its own dependents start only after that wait (so every earlier kernel of the call has finished).
__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// The warp's index in its CTA as a value ptxas knows every lane shares: loops that step whole warps by it
// keep their shuffles single instructions (from threadIdx.x >> 5, each shuffle in them became a
// WARPSYNC / SHFL / ENDCOLLECTIVE loop: FC2's wgmma epilogue 18.5 K -> 13.2 K instructions, the input
// rotation 1072 -> 672).
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x >> 5), 0); }

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

// Two floats -> fp16x2 (lo, hi), rounded to nearest and saturated to +-65504 (an outlier must not become
// inf in an MMA operand; NaN stays NaN): one F2FP.SATFINITE instead of two clamps per value.
__device__ __forceinline__ uint32_t to_half2_sat(float lo, float hi) {
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1)  // PTX ISA 8.1
  uint32_t r;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  auto clamp = [](float f) { return f != f ? f : fminf(fmaxf(f, -65504.0f), 65504.0f); };
  const __half2 h = __floats2half2_rn(clamp(lo), clamp(hi));
  return *reinterpret_cast<const uint32_t*>(&h);
#endif
}

}  // namespace trellis
