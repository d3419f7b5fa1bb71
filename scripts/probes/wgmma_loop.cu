// Decode against Hopper wgmma, alone and together (docs/performance.md, run 52): does the tensor pipe's
// work overlap the integer decode, as the large-tile kernels (expert_wgmma.cuh) assume?
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/wgmma_loop scripts/probes/wgmma_loop.cu && /tmp/wgmma_loop
//
// One CTA of 4 warpgroups per SM, as the kernels run. Each warp walks 64 random 16x16 tiles (mcg, K3 or
// K4) from shared memory, decodes each into merged fp16 A fragments of W^T and issues one
// wgmma.m64n128k16 per tile against 128 random route rows in shared memory (at most two in flight, as
// chunk_wgmma). Variants drop the MMA (decoded words folded by XOR) or the decode (constant fragments).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "../../kernels/decode.cuh"
#include "../../kernels/wgmma.cuh"

using namespace trellis;

// kDecodeAndSsMma: the decode runs as in kDecodeOnly and the MMA reads A from shared memory instead of
// the registers (same count of m64n128k16): whether the register-sourced wgmma is what serializes.
// kLop3*, kFfma*: 40 independent-chain LOP3 or FFMA per tile instead of the decode (about its integer
// count): whether any work overlaps the MMAs, or only some pipes.
enum Mode : int {
  kDecodeAndMma, kDecodeOnly, kMmaOnly, kDecodeAndSsMma, kSsMmaOnly, kLop3AndMma, kLop3Only, kFfmaAndMma, kFfmaOnly
};
__host__ __device__ constexpr bool lop3_mode(int m) { return m == kLop3AndMma || m == kLop3Only; }
__host__ __device__ constexpr bool ffma_mode(int m) { return m == kFfmaAndMma || m == kFfmaOnly; }

#ifdef TRELLIS_DEVICE_WGMMA
// d += A * B with A (64 x 16) from shared memory too.
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], uint64_t a_desc, uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a_desc), "l"(b_desc), "r"(1));
}
#endif
constexpr int kTiles = 64, kThreads = 512;
constexpr int kRowBytes = 128 * 128;  // 128 routes x 64 halves: one swizzled k-half atom group

template <int K, int MODE, int BATCH = 1>
__global__ void __launch_bounds__(kThreads, 1) wgmma_loop(const uint32_t* __restrict__ src, float* out, int iters) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint32_t* s_w = reinterpret_cast<uint32_t*>(smem + kRowBytes);
  for (int i = threadIdx.x; i < kRowBytes / 4; i += kThreads)  // route rows: small fp16 values
    reinterpret_cast<uint32_t*>(smem)[i] = 0x2C002C00u ^ (src[i % (kTiles * 8 * K)] & 0x03FF03FFu);
  for (int i = threadIdx.x; i < kTiles * 8 * K; i += kThreads) s_w[i] = src[i];
  __syncthreads();
#ifdef TRELLIS_DEVICE_WGMMA
  wgmma_fence_shared_writes();
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneWindow win = lane_window<K>(lane);
  const uint32_t rows = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  uint32_t folded = 0;
  uint32_t batch[BATCH][4];
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const int tile = (it * 8 + kt + warp) & (kTiles - 1);
      TileWords t;
      t.u0 = s_w[tile * 8 * K + win.w0];
      t.u1 = s_w[tile * 8 * K + win.w1];
      t.u2 = 0;
      uint32_t b[4];
      if (lop3_mode(MODE) || ffma_mode(MODE)) {
        uint32_t v[4] = {t.u0, t.u1, t.u0 ^ 7u, t.u1 ^ 9u};
        float f[4] = {__uint_as_float(t.u0 & 0x3FFFFFFFu), __uint_as_float(t.u1 & 0x3FFFFFFFu), 1.f, 2.f};
#pragma unroll
        for (int i = 0; i < 10; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (lop3_mode(MODE)) asm volatile("lop3.b32 %0, %0, %1, %2, 0x6A;" : "+r"(v[j]) : "r"(t.u0), "r"(0x3B603B60u));
            else asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(f[j]) : "f"(1.0001f), "f"(0.5f));
          }
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = lop3_mode(MODE) ? v[j] : (__float_as_uint(f[j]) & 0x3FFF3FFFu);
      } else if (MODE == kMmaOnly || MODE == kSsMmaOnly) {
        b[0] = 0x3C003C00u ^ t.u0, b[1] = b[0] ^ 1u, b[2] = b[0] ^ 2u, b[3] = b[0] ^ 3u;
      } else {
        decode_fragments<K, 1>(t, win, b);
      }
      if (MODE == kDecodeOnly || MODE == kDecodeAndSsMma || MODE == kLop3Only || MODE == kFfmaOnly)
        folded ^= b[0] ^ b[1] ^ b[2] ^ b[3];
      if (MODE == kDecodeOnly || MODE == kLop3Only || MODE == kFfmaOnly) continue;
      if (MODE == kDecodeAndSsMma || MODE == kSsMmaOnly) {  // A: the first 64 route rows stand in
        wgmma_wait<1>();
        wgmma_fence();
        wgmma_ss_m64n128k16(acc, swizzled_descriptor(rows + (kt & 3) * 32, 1024),
                            swizzled_descriptor(rows + (kt & 3) * 32, 1024));
        wgmma_commit();
        continue;
      }
      if (BATCH > 1) {  // decode BATCH tiles, then issue their MMAs as one group
        static_assert(8 % BATCH == 0, "batches split a chunk");
        batch[kt % BATCH][0] = b[0], batch[kt % BATCH][1] = b[2], batch[kt % BATCH][2] = b[1], batch[kt % BATCH][3] = b[3];
        if (kt % BATCH == BATCH - 1) {
          wgmma_wait<1>();
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < BATCH; ++j)
            wgmma_m64n128k16(acc, batch[j], swizzled_descriptor(rows + ((kt - BATCH + 1 + j) & 3) * 32, 1024));
          wgmma_commit();
        }
        continue;
      }
      const uint32_t a_frag[4] = {b[0], b[2], b[1], b[3]};
      wgmma_wait<1>();
      wgmma_fence();
      wgmma_m64n128k16(acc, a_frag, swizzled_descriptor(rows + (kt & 3) * 32, 1024));
      wgmma_commit();
    }
    wgmma_wait<0>();  // as chunk_wgmma: every 8 tiles (a chunk) end with their MMAs done
  }
  wgmma_fence_accumulators(acc);
  float r = float(folded & 1);
#pragma unroll
  for (int i = 0; i < 64; ++i) r += acc[i];
  out[blockIdx.x * kThreads + threadIdx.x] = r;
#endif
}

template <int K, int MODE, int BATCH = 1>
double rate(const uint32_t* src, float* out) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int smem = kRowBytes + kTiles * 8 * K * 4, iters = 512;
  cudaFuncSetAttribute(wgmma_loop<K, MODE, BATCH>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  wgmma_loop<K, MODE, BATCH><<<sms, kThreads, smem>>>(src, out, 4);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int rep = 0; rep < 5; ++rep) wgmma_loop<K, MODE, BATCH><<<sms, kThreads, smem>>>(src, out, iters);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  return double(sms) * (kThreads / 32) * iters * 8 * 256 / (ms / 5) / 1e9;
}

int main() {
  const int n = kTiles * 8 * 8;
  std::vector<uint32_t> host(n);
  srand(11);
  for (auto& v : host) v = (uint32_t(rand()) << 16) ^ uint32_t(rand());
  uint32_t* src;
  float* out;
  cudaMalloc(&src, n * 4);
  cudaMalloc(&out, 132 * kThreads * 4);
  cudaMemcpy(src, host.data(), n * 4, cudaMemcpyHostToDevice);
  printf("16 warps per SM, G weights / ms (MMA time per tile = one m64n128k16 per warpgroup)\n");
  printf("  K4  decode + wgmma %5.2f   decode only %5.2f   wgmma only %5.2f\n", rate<4, kDecodeAndMma>(src, out),
         rate<4, kDecodeOnly>(src, out), rate<4, kMmaOnly>(src, out));
  printf("  K3  decode + wgmma %5.2f   decode only %5.2f   wgmma only %5.2f\n", rate<3, kDecodeAndMma>(src, out),
         rate<3, kDecodeOnly>(src, out), rate<3, kMmaOnly>(src, out));
  printf("  A from shared memory: K4 decode + wgmma %5.2f, K3 %5.2f; wgmma only %5.2f\n",
         rate<4, kDecodeAndSsMma>(src, out), rate<3, kDecodeAndSsMma>(src, out), rate<4, kSsMmaOnly>(src, out));
  printf("  MMAs issued in groups of 2 / 4 tiles: K4 decode + wgmma %5.2f / %5.2f, K3 %5.2f / %5.2f\n",
         rate<4, kDecodeAndMma, 2>(src, out), rate<4, kDecodeAndMma, 4>(src, out), rate<3, kDecodeAndMma, 2>(src, out),
         rate<3, kDecodeAndMma, 4>(src, out));
  printf("  40 LOP3 per tile: with wgmma %5.2f, alone %5.2f;  40 FFMA per tile: with wgmma %5.2f, alone %5.2f\n",
         rate<4, kLop3AndMma>(src, out), rate<4, kLop3Only>(src, out), rate<4, kFfmaAndMma>(src, out),
         rate<4, kFfmaOnly>(src, out));
  const cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
