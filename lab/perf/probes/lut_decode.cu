// The decode loop with some states looked up instead of computed: a 65536-entry table of merged fp16
// weights (mcg) in shared memory, one LDS.U16 per looked-up state in place of its IMAD and LOP3
// (on H200 not taken up: every state looked up runs 2.0 G weights/ms, bank-conflict bound; at best K3
// gains 9 % with three of its eight states). The load-store pipe is idle in the decode loop while the integer
// pipes set its speed, so moving part of the states there could raise the rate, if the table's bank
// conflicts (32 random 16-bit entries per warp) leave it enough.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o lut_decode lab/perf/probes/lut_decode.cu && ./lut_decode
//
// As decode_loop.cu: each warp walks 64 random 16x16 tiles (K 3 or 4, mcg) from shared memory, 64 times,
// into split-word MMAs against one block of 8 routes. One CTA of 1024 threads per SM (the table fills
// 128 KB of its shared memory), so 32 warps per SM, as the small-tile kernels run. A looked-up state
// enters the MMA as the word (w, 0): w times the route column plus 0 times its copy. Every looked-up word
// is checked against the merged form of the computed word.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "../../../kernels/decode.cuh"
#include "../../../kernels/warp_ops.cuh"
#include "check.cuh"
#include "staged_tiles.cuh"

using namespace trellis;

constexpr int kTableBytes = 65536 * 2;

__device__ __forceinline__ uint32_t merged(uint32_t word) {
  const __half2 h = bits_half2(word);
  return half2_bits(__hadd2(__low2half2(h), __high2half2(h))) & 0xFFFFu;
}

__global__ void fill_table(uint16_t* table) {
  const uint32_t s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s < 65536) table[s] = uint16_t(merged(codebook_word<1>(s)));
}

// Twice state j of the lane (its byte offset in the table) in two integer instructions: a shift and a
// mask, like most computed states; a computed state then costs an IMAD and a LOP3 more.
template <int K>
__device__ __forceinline__ uint32_t doubled_state(const TileWords& t, const LaneWindow& win, int j) {
  if (K == 4) {  // 2 s_j = (u0:u1 >> (27 - 4j)) & 0x1FFFE
    if (j == 7) return (t.u1 << 1) & 0x1FFFEu;
    if (j >= 3) return (t.u1 >> (27 - 4 * j)) & 0x1FFFEu;
    return __funnelshift_r(t.u1, t.u0, 27 - 4 * j) & 0x1FFFEu;
  }
  if (j <= 1) return (__funnelshift_l(t.u1, t.u0, win.off) >> (15 - 3 * j)) & 0x1FFFEu;
  const uint32_t tail = __funnelshift_lc(t.u1, t.u0, win.off + 5);
  return (j == 7 ? tail << 1 : tail >> (20 - 3 * j)) & 0x1FFFEu;
}

// The table's entry at byte offset `doubled`; the table starts at shared address BASE, an immediate.
template <int BASE>
__device__ __forceinline__ uint32_t table_entry(uint32_t doubled) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1+%2];" : "=h"(v) : "r"(doubled), "n"(BASE));
  return v;
}

__global__ void shared_base(int* base) {
  extern __shared__ __align__(16) uint8_t smem[];
  *base = int(__cvta_generic_to_shared(smem));
}

// MASK: bit j set = state j looked up.
template <int K, uint32_t MASK, int BASE = 0>
__global__ void __launch_bounds__(1024, 1)
    lut_loop(const uint32_t* __restrict__ src, const uint4* __restrict__ table, float* out, int iters, uint32_t* dump) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint4* s_table = reinterpret_cast<uint4*>(smem);
  uint32_t* s_w = reinterpret_cast<uint32_t*>(smem + kTableBytes);
  if (__cvta_generic_to_shared(smem) != BASE) __trap();
  if (MASK != 0)
    for (int i = threadIdx.x; i < kTableBytes / 16; i += blockDim.x) s_table[i] = table[i];
  for (int i = threadIdx.x; i < kTiles * 8 * K; i += blockDim.x) s_w[i] = src[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneWindow win = lane_window<K>(lane);
  uint32_t rows[4];
  route_stand_ins(lane, rows);
  float acc[2][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll 8
    for (int kt = 0; kt < kTiles; ++kt) {
      const int tile = warp_tile(kt, warp);
      const TileWords t = staged_tile<K>(s_w, tile, win);
      uint32_t x[8];
      lane_states<K>(t, win, x);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        x[j] = ((MASK >> j) & 1) ? table_entry<BASE>(doubled_state<K>(t, win, j)) : codebook_word<1>(x[j]);
      if (dump && it == 0 && blockIdx.x == 0 && warp == 0)
        for (int j = 0; j < 8; ++j) dump[(tile * 32 + lane) * 8 + j] = x[j];
      const uint32_t even[4] = {x[0], x[4], x[2], x[6]}, odd[4] = {x[1], x[5], x[3], x[7]};
      mma_16816(acc[0], even, rows[0], rows[1]);
      mma_16816(acc[1], odd, rows[2], rows[3]);
    }
  }
  float r = 0;
  for (int n = 0; n < 2; ++n)
    for (int i = 0; i < 4; ++i) r += acc[n][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

// Looked-up words that differ from the merged computed word.
__global__ void count_wrong(const uint32_t* base, const uint32_t* lut, uint32_t mask, int n, int* wrong) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int j = i % 8;
  const uint32_t want = ((mask >> j) & 1) ? merged(base[i]) : base[i];
  if (lut[i] != want) atomicAdd(wrong, 1);
}

struct Buffers {
  uint32_t *src, *dump, *base_dump;
  uint4* table;
  float* out;
  int* wrong;
};

template <int K, uint32_t MASK, int BASE>
double rate(const Buffers& b, int* wrong) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int smem = kTableBytes + kTiles * 8 * K * 4, iters = 64;
  cudaFuncSetAttribute(lut_loop<K, MASK, BASE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  uint32_t* dump = MASK == 0 ? b.base_dump : b.dump;
  lut_loop<K, MASK, BASE><<<sms, 1024, smem>>>(b.src, b.table, b.out, 1, dump);
  *wrong = 0;
  if (MASK != 0) {
    const int n = kTiles * 32 * 8;
    cudaMemset(b.wrong, 0, 4);
    count_wrong<<<(n + 255) / 256, 256>>>(b.base_dump, b.dump, MASK, n, b.wrong);
    cudaMemcpy(wrong, b.wrong, 4, cudaMemcpyDeviceToHost);
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int rep = 0; rep < 5; ++rep) lut_loop<K, MASK, BASE><<<sms, 1024, smem>>>(b.src, b.table, b.out, iters, nullptr);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  return double(sms) * 32 * iters * kTiles * 256 / (ms / 5) / 1e9;
}

template <int K, uint32_t MASK, int BASE>
bool report(const Buffers& b, const char* name) {
  int wrong = 0;
  const double g = rate<K, MASK, BASE>(b, &wrong);
  printf("  K%d  %-34s mask 0x%02X  %5.2f G weights/ms  (%d looked-up words wrong)\n", K, name, MASK, g, wrong);
  return wrong == 0;
}

template <int K, int BASE>
bool report_all(const Buffers& b) {
  bool ok = report<K, 0x00, BASE>(b, "all computed");
  if (K == 4) {
    ok = report<K, 0x88, BASE>(b, "states 3, 7 looked up") && ok;
    ok = report<K, 0x44, BASE>(b, "states 2, 6") && ok;
    ok = report<K, 0xCC, BASE>(b, "states 2, 3, 6, 7") && ok;
    ok = report<K, 0xF0, BASE>(b, "states 4-7") && ok;
  } else {
    ok = report<K, 0x04, BASE>(b, "state 2 looked up") && ok;
    ok = report<K, 0x24, BASE>(b, "states 2, 5") && ok;
    ok = report<K, 0x54, BASE>(b, "states 2, 4, 6") && ok;
    ok = report<K, 0x3C, BASE>(b, "states 2-5") && ok;
    ok = report<K, 0xFC, BASE>(b, "states 2-7") && ok;
  }
  ok = report<K, 0xFF, BASE>(b, "all looked up") && ok;
  return ok;
}

template <int BASE>
bool report_both(const Buffers& b) {
  printf("32 warps per SM (one CTA of 1024 threads), split-word MMAs against 1 block of 8 routes:\n");
  const bool ok = report_all<4, BASE>(b);
  return report_all<3, BASE>(b) && ok;
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const int n = kTiles * 8 * 8;
  std::vector<uint32_t> host(n);
  srand(7);
  for (auto& v : host) v = (uint32_t(rand()) << 16) ^ uint32_t(rand());
  Buffers b;
  CHECK(cudaMalloc(&b.src, n * 4));
  CHECK(cudaMalloc(&b.dump, kTiles * 32 * 8 * 4));
  CHECK(cudaMalloc(&b.base_dump, kTiles * 32 * 8 * 4));
  CHECK(cudaMalloc(&b.table, kTableBytes));
  CHECK(cudaMalloc(&b.out, 132 * 1024 * 4));
  CHECK(cudaMalloc(&b.wrong, 4));
  CHECK(cudaMemcpy(b.src, host.data(), n * 4, cudaMemcpyHostToDevice));
  fill_table<<<256, 256>>>(reinterpret_cast<uint16_t*>(b.table));
  int base = -1;
  CHECK(cudaFuncSetAttribute(shared_base, cudaFuncAttributeMaxDynamicSharedMemorySize, kTableBytes));
  shared_base<<<1, 1, kTableBytes>>>(b.wrong);
  CHECK(cudaMemcpy(&base, b.wrong, 4, cudaMemcpyDeviceToHost));
  printf("dynamic shared memory starts at shared address %d\n", base);
  bool ok = false;
  if (base == 0)
    ok = report_both<0>(b);
  else if (base == 1024)
    ok = report_both<1024>(b);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess && ok ? 0 : 1;
}
