// Which instruction mixes share the integer budget of the decode (on H200 each integer pipe alone issues
// 2 warp instructions per clock per SM and any two together about 3: one shared budget; DFMA is apart).
//
//   nvcc -O3 -arch=sm_90a -o pipe_mix lab/perf/probes/pipe_mix.cu && ./pipe_mix
//
// Every thread runs 8 independent chains of the chosen instructions (inline PTX, so nothing is folded),
// 64 warps per SM; the result is warp instructions issued per clock per SM at the reported clock.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

constexpr int kIters = 4096;
enum : int { kLop3 = 1, kImad = 2, kDfma = 4, kFfma = 8, kHfma2 = 16, kShf = 32, kPrmt = 64 };

template <int MIX>
__global__ void __launch_bounds__(256) mix(uint32_t* out, uint32_t seed) {
  uint32_t a[8], h[8];
  double d[8];
  float f[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    a[i] = seed + threadIdx.x * 17 + i;
    h[i] = a[i] * 3u;
    d[i] = double(a[i] & 0xFFFF);
    f[i] = float(a[i]);
  }
  const uint32_t k1 = seed | 1u, k2 = seed ^ 0x55u;
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (MIX & kLop3) asm volatile("lop3.b32 %0, %0, %1, %2, 0x6A;" : "+r"(a[i]) : "r"(k1), "r"(k2));
      if (MIX & kImad) asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(h[i]) : "r"(k1), "r"(k2));
      if (MIX & kDfma) asm volatile("fma.rn.f64 %0, %0, %1, %2;" : "+d"(d[i]) : "d"(3.0000001), "d"(1.0e-3));
      if (MIX & kFfma) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(f[i]) : "f"(1.0001f), "f"(0.5f));
      if (MIX & kHfma2)
        asm volatile("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(h[i]) : "r"(0x3C003C00u), "r"(0x00010001u));
      if (MIX & kShf) asm volatile("shf.r.clamp.b32 %0, %0, %1, %2;" : "+r"(a[i]) : "r"(k2), "r"(k1));
      if (MIX & kPrmt) asm volatile("prmt.b32 %0, %0, %1, %2;" : "+r"(a[i]) : "r"(k2), "r"(0x5410u));
    }
  }
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) r ^= a[i] ^ h[i] ^ uint32_t(__double2loint(d[i])) ^ __float_as_uint(f[i]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

template <int MIX>
void run(const char* name, uint32_t* out) {
  constexpr int kOps = __builtin_popcount(MIX);
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const int blocks = sms * 8;
  mix<MIX><<<blocks, 256>>>(out, 1);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int rep = 0; rep < 5; ++rep) mix<MIX><<<blocks, 256>>>(out, rep + 2);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  ms /= 5;
  const double warp_instructions = double(blocks) * 8 * kIters * 8 * kOps;
  const double cycles = ms * 1e-3 * clock_khz * 1e3;
  printf("%-18s %7.3f ms  %5.2f warp instructions / clock / SM (clock %d MHz)\n", name, ms,
         warp_instructions / cycles / sms, clock_khz / 1000);
}

int main() {
  uint32_t* out;
  cudaMalloc(&out, 132 * 8 * 256 * 4 * 2);
  run<kLop3>("lop3", out);
  run<kImad>("imad", out);
  run<kDfma>("dfma", out);
  run<kFfma>("ffma", out);
  run<kHfma2>("hfma2", out);
  run<kShf>("shf", out);
  run<kPrmt>("prmt", out);
  run<kLop3 | kImad>("lop3+imad", out);
  run<kLop3 | kDfma>("lop3+dfma", out);
  run<kLop3 | kFfma>("lop3+ffma", out);
  run<kLop3 | kHfma2>("lop3+hfma2", out);
  run<kImad | kDfma>("imad+dfma", out);
  run<kLop3 | kImad | kDfma>("lop3+imad+dfma", out);
  run<kLop3 | kImad | kHfma2>("lop3+imad+hfma2", out);
  run<kShf | kImad>("shf+imad", out);
  run<kPrmt | kDfma>("prmt+dfma", out);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
