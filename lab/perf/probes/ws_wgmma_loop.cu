// Warp-specialized decode and wgmma: do producer warpgroups that decode into shared memory, beside
// consumer warpgroups that only issue the MMAs, overlap the two better than wgmma_loop's decode + wgmma on
// the same warps (85-90 % of the sum of their times, runs 52 and 56)?
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o ws_wgmma_loop lab/perf/probes/ws_wgmma_loop.cu && ./ws_wgmma_loop
//
// One CTA per SM of P producer and C consumer warpgroups. A stage is a 64-row x k64 fp16 A tile in
// shared memory in the 128-byte swizzled K-major layout (8 KB, 16 weight tiles of 16x16): warp w of a
// producer warpgroup decodes rows 16w..16w+15 of its 4 k16 steps (mcg, K3 or K4, random tiles from shared
// memory as in wgmma_loop), stores its A fragments there, fences them for the async proxy and arrives on
// the stage's "full" mbarrier. A consumer waits on it, issues 4 wgmma.m64nNk16 with A and B (N random
// route rows) from shared memory, and once that group has finished (one group left in flight) arrives on
// the stage's "empty" mbarrier. Producer p fills stages p, p + P, ...; consumer c takes c, c + C, ...; a
// ring of S stages. Modes: both, the producers alone (the consumers hand stages straight back), the
// consumers alone (the producers hand stages over without decoding). Rates in G weights / ms as
// wgmma_loop prints them.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "../../../kernels/decode.cuh"
#include "../../../kernels/wgmma.cuh"
#include "staged_tiles.cuh"
#include "wgmma_ss.cuh"

using namespace trellis;

enum WsMode : int { kBoth, kProducersOnly, kConsumersOnly };

constexpr int kRowBytes = 128 * 128;  // B: 128 route rows x 64 halves (one k64 swizzled atom per row)
constexpr int kStageBytes = 64 * 128;  // A: 64 weight rows x 64 halves
constexpr int kStagesPerCta = 4096;    // 65536 weight tiles per CTA, as wgmma_loop's 16 warps x 512 x 8

#ifdef TRELLIS_DEVICE_WGMMA
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the barrier's phase of this parity has completed (a fresh barrier counts its phase before
// the first, parity 1, as complete: the producers' first pass over the ring does not wait).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWS_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WS_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t address, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(v) : "memory");
}
// Byte address of A element (row r, k column c) in a 64 x 64 swizzled stage.
__device__ __forceinline__ uint32_t a_offset(int r, int c) {
  return r * 128 + ((((c >> 3) ^ (r & 7)) & 7) << 4) + (c & 7) * 2;
}
#endif

template <int K, int MODE, int P, int C, int N, int S>
__global__ void __launch_bounds__((P + C) * 128, 1) ws_loop(const uint32_t* __restrict__ src, float* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* s_stages = smem + kRowBytes;
  uint32_t* s_w = reinterpret_cast<uint32_t*>(s_stages + S * kStageBytes);
  constexpr int kThreads = (P + C) * 128;
  for (int i = threadIdx.x; i < kRowBytes / 4; i += kThreads)  // route rows: small fp16 values
    reinterpret_cast<uint32_t*>(smem)[i] = 0x2C002C00u ^ (src[i % (kTiles * 8 * K)] & 0x03FF03FFu);
  for (int i = threadIdx.x; i < S * kStageBytes / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(s_stages)[i] = 0x30003000u ^ (src[i % (kTiles * 8 * K)] & 0x01FF01FFu);
  for (int i = threadIdx.x; i < kTiles * 8 * K; i += kThreads) s_w[i] = src[i];
#ifdef TRELLIS_DEVICE_WGMMA
  // mbarriers after the tiles: full[S], then empty[S]
  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(s_w + kTiles * 8 * K));
  if (threadIdx.x == 0)
    for (int s = 0; s < S; ++s) mbar_init(bars + 8 * s, 128), mbar_init(bars + 8 * (S + s), 128);
  wgmma_fence_shared_writes();
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
  const uint32_t rows = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t stages = static_cast<uint32_t>(__cvta_generic_to_shared(s_stages));
  float r = 0.f;
  if (wg < P) {  // producer
    const LaneWindow win = lane_window<K>(lane);
    const int w = warp & 3, g = lane >> 2, t = lane & 3;
    uint32_t folded = 0;
    for (int i = wg; i < kStagesPerCta; i += P) {
      const int s = i % S, use = i / S;
      mbar_wait(bars + 8 * (S + s), (use & 1) ^ 1);
      if (MODE != kConsumersOnly) {
        const uint32_t base = stages + s * kStageBytes;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const TileWords tw = staged_tile<K>(s_w, (i * 16 + w * 4 + j) & (kTiles - 1), win);
          uint32_t b[4];
          decode_fragments<K, 1>(tw, win, b);
          const int row = 16 * w + g, col = 16 * j + 2 * t;
          st_shared(base + a_offset(row, col), b[0]);
          st_shared(base + a_offset(row, col + 8), b[1]);
          st_shared(base + a_offset(row + 8, col), b[2]);
          st_shared(base + a_offset(row + 8, col + 8), b[3]);
          folded ^= b[0];
        }
        wgmma_fence_shared_writes();
      }
      mbar_arrive(bars + 8 * s);
    }
    r = float(folded & 1);
  } else {  // consumer
    const int c = wg - P;
    float acc[64];
#pragma unroll
    for (int k = 0; k < N / 2; ++k) acc[k] = 0.f;
    int pending = -1;
    for (int i = c; i < kStagesPerCta; i += C) {
      const int s = i % S, use = i / S;
      mbar_wait(bars + 8 * s, use & 1);
      if (MODE != kProducersOnly) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j)
          wgmma_ss<N>(acc, swizzled_descriptor(stages + s * kStageBytes + 32 * j, 1024),
                      swizzled_descriptor(rows + 32 * j, 1024));
        wgmma_commit();
        wgmma_wait<1>();
        if (pending >= 0) mbar_arrive(bars + 8 * (S + pending));
        pending = s;
      } else {
        mbar_arrive(bars + 8 * (S + s));
      }
    }
    wgmma_wait<0>();
    if (pending >= 0) mbar_arrive(bars + 8 * (S + pending));
    wgmma_fence_accumulators(acc);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) r += acc[k];
  }
  out[blockIdx.x * kThreads + threadIdx.x] = r;
#endif
}

template <int K, int MODE, int P, int C, int N, int S = 6>
double ws_rate(const uint32_t* src, float* out) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int smem = kRowBytes + S * kStageBytes + kTiles * 8 * K * 4 + 2 * S * 8;
  auto kernel = ws_loop<K, MODE, P, C, N, S>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  constexpr int threads = (P + C) * 128;
  kernel<<<sms, threads, smem>>>(src, out);
  const float ms = mean_launch_ms([&] { kernel<<<sms, threads, smem>>>(src, out); });
  return double(sms) * kStagesPerCta * 4096 / ms / 1e9;
}

template <int K, int P, int C, int N>
void line(const uint32_t* src, float* out) {
  printf("  K%d  %d producer + %d consumer WGs  N = %3d:  both %5.2f   producers alone %5.2f   consumers alone %5.2f\n",
         K, P, C, N, ws_rate<K, kBoth, P, C, N>(src, out), ws_rate<K, kProducersOnly, P, C, N>(src, out),
         ws_rate<K, kConsumersOnly, P, C, N>(src, out));
}

int main() {
  const uint32_t* src = random_tile_words();
  float* out;
  cudaMalloc(&out, 132 * 1024 * 4);
  printf("warp-specialized decode -> shared memory -> wgmma (A and B from shared memory), G weights / ms\n");
  line<4, 3, 1, 32>(src, out);
  line<4, 3, 1, 96>(src, out);
  line<4, 3, 1, 128>(src, out);
  line<3, 3, 1, 32>(src, out);
  line<3, 3, 1, 96>(src, out);
  line<4, 2, 2, 32>(src, out);
  line<4, 2, 2, 96>(src, out);
  line<3, 2, 2, 96>(src, out);
  line<4, 5, 1, 32>(src, out);
  line<4, 5, 1, 96>(src, out);
  line<3, 5, 1, 96>(src, out);
  line<4, 6, 2, 32>(src, out);
  printf("ring of 3 / 12 stages, K4 3 + 1, N = 96: both %5.2f / %5.2f\n", ws_rate<4, kBoth, 3, 1, 96, 3>(src, out),
         ws_rate<4, kBoth, 3, 1, 96, 12>(src, out));
  const cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
