// Decode against Hopper wgmma, alone and together: does the tensor pipe's work overlap the integer
// decode, as the large-tile kernels (expert_wgmma.cuh) assume? (On H200, barely: together they take
// 85-90 % of the sum of their times alone.)
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o wgmma_loop lab/perf/probes/wgmma_loop.cu && ./wgmma_loop [new]
//
// One CTA of 4 warpgroups per SM, as the kernels run. Each warp walks 64 random 16x16 tiles (mcg, K3 or
// K4) from shared memory, decodes each into merged fp16 A fragments of W^T and issues one
// wgmma.m64nNk16 per tile against N random route rows in shared memory (at most two in flight, as
// chunk_wgmma). Variants drop the MMA (decoded words folded by XOR) or the decode (constant fragments),
// take turns to issue the MMAs (ping-pong), accumulate in fp16, change N or run two CTAs per SM; `new`
// prints only the run-56 lines.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "../../../kernels/decode.cuh"
#include "../../../kernels/wgmma.cuh"
#include "staged_tiles.cuh"
#include "wgmma_ss.cuh"

using namespace trellis;

// kDecodeAndSsMma: the decode runs as in kDecodeOnly and the MMA reads A from shared memory instead of
// the registers (same count of m64n128k16): whether the register-sourced wgmma is what serializes.
// kLop3*, kFfma*: 40 independent-chain LOP3 or FFMA per tile instead of the decode (about its integer
// count): whether any work overlaps the MMAs, or only some pipes.
// *Acc16: the same MMAs with fp16 accumulators (half the accumulator registers the tensor cores read and
// write): whether the register file's traffic is what the two kinds of work share.
enum Mode : int {
  kDecodeAndMma, kDecodeOnly, kMmaOnly, kDecodeAndSsMma, kSsMmaOnly, kLop3AndMma, kLop3Only, kFfmaAndMma, kFfmaOnly,
  kDecodeAndMmaAcc16, kMmaOnlyAcc16, kFfmaAndMmaAcc16
};
__host__ __device__ constexpr bool acc16_mode(int m) {
  return m == kDecodeAndMmaAcc16 || m == kMmaOnlyAcc16 || m == kFfmaAndMmaAcc16;
}
__host__ __device__ constexpr bool lop3_mode(int m) { return m == kLop3AndMma || m == kLop3Only; }
__host__ __device__ constexpr bool ffma_mode(int m) {
  return m == kFfmaAndMma || m == kFfmaOnly || m == kFfmaAndMmaAcc16;
}

#ifdef TRELLIS_DEVICE_WGMMA
// d += A * B with fp16 accumulators (d: 64 x 128 as 32 registers of half pairs).
__device__ __forceinline__ void wgmma_m64n128k16_acc16(uint32_t (&d)[32], const uint32_t a[4], uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f16.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
}
// Ping-pong: the warpgroups take turns to issue their MMA groups, a token passed round by named barriers
// (barrier 1 + w is warpgroup w's turn), so one decodes while another's MMAs run.
__device__ __forceinline__ void wait_turn(int wg) { asm volatile("bar.sync %0, 256;" ::"r"(1 + wg) : "memory"); }
__device__ __forceinline__ void pass_turn(int next) { asm volatile("bar.arrive %0, 256;" ::"r"(1 + next) : "memory"); }
#endif
constexpr int kRowBytes = 128 * 128;  // 128 routes x 64 halves: one swizzled k-half atom group

template <int K, int MODE, int BATCH = 1, int kThreads = 512, bool RING = false, int N = 128, int CTAS = 1>
__global__ void __launch_bounds__(kThreads, CTAS) wgmma_loop(const uint32_t* __restrict__ src, float* out, int iters) {
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
  const int wg = warp >> 2, warpgroups = kThreads / 128;
  float acc[64];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  uint32_t acc16[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc16[i] = 0;
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
      } else if (MODE == kMmaOnly || MODE == kSsMmaOnly || MODE == kMmaOnlyAcc16) {
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
        wgmma_ss<128>(acc, swizzled_descriptor(rows + (kt & 3) * 32, 1024),
                            swizzled_descriptor(rows + (kt & 3) * 32, 1024));
        wgmma_commit();
        continue;
      }
      if (BATCH > 1) {  // decode BATCH tiles, then issue their MMAs as one group
        static_assert(8 % BATCH == 0, "batches split a chunk");
        batch[kt % BATCH][0] = b[0], batch[kt % BATCH][1] = b[2], batch[kt % BATCH][2] = b[1], batch[kt % BATCH][3] = b[3];
        if (kt % BATCH == BATCH - 1) {
          wgmma_wait<1>();
          const bool first = it == 0 && kt == BATCH - 1, last = it == iters - 1 && kt == 7;
          if (RING && !(first && wg == 0)) wait_turn(wg);
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < BATCH; ++j)
            wgmma_m64nNk16<N>(acc, batch[j], swizzled_descriptor(rows + ((kt - BATCH + 1 + j) & 3) * 32, 1024));
          wgmma_commit();
          if (RING && !(last && wg == warpgroups - 1)) pass_turn((wg + 1) % warpgroups);
        }
        continue;
      }
      const uint32_t a_frag[4] = {b[0], b[2], b[1], b[3]};
      wgmma_wait<1>();
      wgmma_fence();
      if (acc16_mode(MODE)) wgmma_m64n128k16_acc16(acc16, a_frag, swizzled_descriptor(rows + (kt & 3) * 32, 1024));
      else wgmma_m64nNk16<N>(acc, a_frag, swizzled_descriptor(rows + (kt & 3) * 32, 1024));
      wgmma_commit();
    }
    wgmma_wait<0>();  // as chunk_wgmma: every 8 tiles (a chunk) end with their MMAs done
  }
  wgmma_fence_accumulators(acc);
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(acc16[i])::"memory");
  float r = float(folded & 1);
#pragma unroll
  for (int i = 0; i < 32; ++i) r += __half2float(__ushort_as_half(acc16[i] & 0xFFFF));
#pragma unroll
  for (int i = 0; i < N / 2; ++i) r += acc[i];
  out[blockIdx.x * kThreads + threadIdx.x] = r;
#endif
}

template <int K, int MODE, int BATCH = 1, int kThreads = 512, bool RING = false, int N = 128, int CTAS = 1>
double rate(const uint32_t* src, float* out) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int smem = kRowBytes + kTiles * 8 * K * 4, iters = 512;
  cudaFuncSetAttribute(wgmma_loop<K, MODE, BATCH, kThreads, RING, N, CTAS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  wgmma_loop<K, MODE, BATCH, kThreads, RING, N, CTAS><<<CTAS * sms, kThreads, smem>>>(src, out, 4);
  const float ms = mean_launch_ms(
      [&] { wgmma_loop<K, MODE, BATCH, kThreads, RING, N, CTAS><<<CTAS * sms, kThreads, smem>>>(src, out, iters); });
  return double(CTAS * sms) * (kThreads / 32) * iters * 8 * 256 / ms / 1e9;
}

int main(int argc, char** argv) {
  const bool all = argc < 2 || argv[1][0] != 'n';  // "new": the ping-pong and fp16-accumulator lines only
  const uint32_t* src = random_tile_words();
  float* out;
  cudaMalloc(&out, 132 * 512 * 4);
  if (all) {
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
  }
  printf("ping-pong (MMA groups issued in turns), decode + wgmma: K4 4 WGs groups of 2 / 4 / 8: %5.2f / %5.2f / %5.2f\n",
         rate<4, kDecodeAndMma, 2, 512, true>(src, out), rate<4, kDecodeAndMma, 4, 512, true>(src, out),
         rate<4, kDecodeAndMma, 8, 512, true>(src, out));
  printf("  K3 4 WGs groups of 4 / 8: %5.2f / %5.2f;  2 WGs (8 warps) K4 groups of 4 / 8: %5.2f / %5.2f, no turns %5.2f\n",
         rate<3, kDecodeAndMma, 4, 512, true>(src, out), rate<3, kDecodeAndMma, 8, 512, true>(src, out),
         rate<4, kDecodeAndMma, 4, 256, true>(src, out), rate<4, kDecodeAndMma, 8, 256, true>(src, out),
         rate<4, kDecodeAndMma, 4, 256, false>(src, out));
  printf("fp16 accumulators: K4 decode + wgmma %5.2f, K3 %5.2f, wgmma only %5.2f, 40 FFMA + wgmma %5.2f\n",
         rate<4, kDecodeAndMmaAcc16>(src, out), rate<3, kDecodeAndMmaAcc16>(src, out), rate<4, kMmaOnlyAcc16>(src, out),
         rate<4, kFfmaAndMmaAcc16>(src, out));
  printf("by the MMA's N (routes), K4 / K3: decode + wgmma, wgmma only (G weights / ms)\n");
  printf("  N = 32: %5.2f / %5.2f, %5.2f;  N = 64: %5.2f / %5.2f, %5.2f;  N = 96: %5.2f / %5.2f, %5.2f\n",
         rate<4, kDecodeAndMma, 1, 512, false, 32>(src, out), rate<3, kDecodeAndMma, 1, 512, false, 32>(src, out),
         rate<4, kMmaOnly, 1, 512, false, 32>(src, out), rate<4, kDecodeAndMma, 1, 512, false, 64>(src, out),
         rate<3, kDecodeAndMma, 1, 512, false, 64>(src, out), rate<4, kMmaOnly, 1, 512, false, 64>(src, out),
         rate<4, kDecodeAndMma, 1, 512, false, 96>(src, out), rate<3, kDecodeAndMma, 1, 512, false, 96>(src, out),
         rate<4, kMmaOnly, 1, 512, false, 96>(src, out));
  printf("N = 32, decode + wgmma K4 / K3: two CTAs (32 warps) per SM %5.2f / %5.2f, one %5.2f / %5.2f\n",
         rate<4, kDecodeAndMma, 1, 512, false, 32, 2>(src, out), rate<3, kDecodeAndMma, 1, 512, false, 32, 2>(src, out),
         rate<4, kDecodeAndMma, 1, 512, false, 32, 1>(src, out), rate<3, kDecodeAndMma, 1, 512, false, 32, 1>(src, out));
  printf("  decode only K4 / K3 %5.2f / %5.2f\n", rate<4, kDecodeOnly, 1, 512, false, 32, 2>(src, out),
         rate<3, kDecodeOnly, 1, 512, false, 32, 2>(src, out));
  const cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
