// The decode loop alone: trellis words from shared memory -> codebook words -> mma.sync, per variant
// (on H200 the kernels' split-word loop runs 4.06 G weights/ms for K4 and 3.46 for K3 at 32 warps per SM).
// Prints decoded weights per ms over the whole GPU.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o decode_loop lab/perf/probes/decode_loop.cu && ./decode_loop
//
// Each warp walks 64 random 16x16 tiles (K 3 or 4, mcg) held in shared memory, 64 times, and multiplies
// every decoded tile into NB blocks of 8 routes (registers stand in for the route operand). Variants
// that compute the same codebook words another way are checked bit-exact against the IMAD path.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "../../../kernels/decode.cuh"
#include "../../../kernels/warp_ops.cuh"
#include "staged_tiles.cuh"

using namespace trellis;

enum Variant : int {
  kSplitAsB,       // split words as B fragments against 16-row A blocks: 4 MMAs per tile (the former layout)
  kSplitAsA,       // split words as A fragments of W^T, routes as n = 8: 2 MMAs per tile and block
  kMergedAsA,      // merged fp16 weights (PRMT + HADD2) as A of W^T: 1 MMA per tile and block
  kMergedAsB,      // merged weights as B against 16-row A blocks: 2 MMAs per tile
  kDecodeOnly,     // split words, folded by XOR instead of multiplied
  kMmaOnly,        // 4 MMAs per tile on words made by one IMAD each
  kDfmaPair,       // mcg multiply as DFMA on (2^52 + s): ptxas writes the constant high word per state
  kI2fHalfDfma,    // state -> double by I2F.F64.U16 reading a 16-bit half (no mask), then DFMA
  kI2fWordDfma,    // masked state -> double by I2F.F64.U32, then DFMA
  kK3ImadStates,   // K3: the five shift-and-mask states as IMAD.SHL + IMAD.HI (IMAD pipe) instead of SHF + LOP3
  kK3ImadSome,     // K3: three of them (j = 1..3)
};

// (w << n) >> 16 on the IMAD pipe: a multiply by 2^n, then the high word of a multiply by 2^16.
__device__ __forceinline__ uint32_t top16_after_shl_imad(uint32_t w, int n) {
  uint32_t shifted, top;
  asm("mul.lo.u32 %0, %1, %2;" : "=r"(shifted) : "r"(w), "r"(1u << n));
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(top) : "r"(shifted), "r"(65536u));
  return top;
}

__device__ __forceinline__ uint32_t low_word(double r) { return uint32_t(__double2loint(r)); }
// 2^52 + s * C for an integral double s < 2^16: exact, and its low word is s * C mod 2^32. (The pair form
// computes the same from 2^52 + s.)
__device__ __forceinline__ uint32_t mcg_by_dfma(double s) { return low_word(__fma_rn(s, 3417055213.0, 0x1p52)); }

template <int K, int V>
__device__ __forceinline__ void words(const TileWords& t, const LaneWindow& win, uint32_t x[8]) {
  if (V == kMmaOnly) {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = t.u0 + j * t.u1;
  } else if (V == kMergedAsA || V == kMergedAsB) {
    decode_fragments<K, 1>(t, win, x);  // x[0..3]
  } else if (V == kDfmaPair || V == kI2fWordDfma) {
    uint32_t s[8];
    lane_states<K>(t, win, s);
    constexpr double kC = 3417055213.0;  // the mcg multiplier
#pragma unroll
    for (int j = 0; j < 8; ++j)
      x[j] = lop3_and_xor(V == kDfmaPair
                              ? low_word(__fma_rn(__hiloint2double(0x43300000, int(s[j])), kC, 0x1p52 - 0x1p52 * kC))
                              : mcg_by_dfma(double(s[j])));
  } else if (V == kI2fHalfDfma) {  // every state is a 16-bit half of some word
    double d[8];
    if (K == 4) {
      const uint32_t w4 = __funnelshift_r(t.u1, t.u0, 4), w8 = __funnelshift_r(t.u1, t.u0, 8),
                     w12 = __funnelshift_r(t.u1, t.u0, 12);
      d[0] = double(w12 >> 16), d[1] = double(w8 >> 16), d[2] = double(w4 >> 16), d[3] = double(t.u1 >> 16);
      d[4] = double(uint16_t(w12)), d[5] = double(uint16_t(w8)), d[6] = double(uint16_t(w4));
      d[7] = double(uint16_t(t.u1));
    } else {
      const uint32_t hi = __funnelshift_l(t.u1, t.u0, win.off), lo = t.u1 << win.off;
      d[0] = double(hi >> 16);
#pragma unroll
      for (int j = 1; j <= 5; ++j) d[j] = double(uint16_t(hi >> (16 - 3 * j)));
#pragma unroll
      for (int j = 6; j <= 7; ++j) d[j] = double(__funnelshift_l(lo, hi, 3 * j) >> 16);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = lop3_and_xor(mcg_by_dfma(d[j]));
  } else if ((V == kK3ImadStates || V == kK3ImadSome) && K == 3) {
    const uint32_t hi = __funnelshift_l(t.u1, t.u0, win.off), lo = t.u1 << win.off;
    uint32_t s[8];
    s[0] = hi >> 16;
#pragma unroll
    for (int j = 1; j <= 5; ++j)
      s[j] = (V == kK3ImadStates || j <= 3) ? top16_after_shl_imad(hi, 3 * j) : (hi >> (16 - 3 * j)) & 0xFFFFu;
#pragma unroll
    for (int j = 6; j <= 7; ++j) s[j] = __funnelshift_l(lo, hi, 3 * j) >> 16;
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = codebook_word<1>(s[j]);
  } else {
    decode_words<K, 1>(t, win, x);
  }
}


template <int K, int V, int NB>
__global__ void __launch_bounds__(256) decode_loop(const uint32_t* __restrict__ src, float* out, int iters,
                                                   uint32_t* dump) {
  __shared__ uint32_t s_w[kTiles * 8 * K];
  for (int i = threadIdx.x; i < kTiles * 8 * K; i += blockDim.x) s_w[i] = src[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneWindow win = lane_window<K>(lane);
  uint32_t rows[4];
  route_stand_ins(lane, rows);
  float acc[2][4] = {};
  uint32_t folded = 0;
  for (int it = 0; it < iters; ++it) {
#pragma unroll 8
    for (int kt = 0; kt < kTiles; ++kt) {
      const int tile = warp_tile(kt, warp);
      const TileWords t = staged_tile<K>(s_w, tile, win);
      uint32_t x[8];
      words<K, V>(t, win, x);
      if (dump && it == 0 && blockIdx.x == 0 && warp == 0)
        for (int j = 0; j < 8; ++j) dump[(tile * 32 + lane) * 8 + j] = x[j];
      if (V == kDecodeOnly) {
        folded ^= x[0] ^ x[1] ^ x[2] ^ x[3] ^ x[4] ^ x[5] ^ x[6] ^ x[7];
      } else if (V == kSplitAsA || V == kK3ImadStates || V == kK3ImadSome) {
        const uint32_t even[4] = {x[0], x[4], x[2], x[6]}, odd[4] = {x[1], x[5], x[3], x[7]};
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          mma_16816(acc[b & 1], even, rows[0] + b, rows[1]);
          mma_16816(acc[b & 1], odd, rows[2] + b, rows[3]);
        }
      } else if (V == kMergedAsA) {
        const uint32_t a[4] = {x[0], x[2], x[1], x[3]};
#pragma unroll
        for (int b = 0; b < NB; ++b) mma_16816(acc[b & 1], a, rows[0] + b, rows[1]);
      } else if (V == kMergedAsB) {
        mma_16816(acc[0], rows, x[0], x[1]);
        mma_16816(acc[1], rows, x[2], x[3]);
      } else {  // split words as B: even and odd A blocks
        mma_16816(acc[0], rows, x[0], x[2]);
        mma_16816(acc[0], rows, x[1], x[3]);
        mma_16816(acc[1], rows, x[4], x[6]);
        mma_16816(acc[1], rows, x[5], x[7]);
      }
    }
  }
  float r = float(folded & 1);
  for (int n = 0; n < 2; ++n)
    for (int i = 0; i < 4; ++i) r += acc[n][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

struct Buffers {
  uint32_t *src, *dump;
  float* out;
};

// G weights per ms at `warps_per_sm`; `words` receives the first warp's codebook words.
template <int K, int V, int NB = 1>
double rate(const Buffers& b, std::vector<uint32_t>& words, int warps_per_sm) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int blocks = sms * warps_per_sm / 8, iters = 64;
  decode_loop<K, V, NB><<<blocks, 256>>>(b.src, b.out, 1, b.dump);
  cudaMemcpy(words.data(), b.dump, words.size() * 4, cudaMemcpyDeviceToHost);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int rep = 0; rep < 5; ++rep) decode_loop<K, V, NB><<<blocks, 256>>>(b.src, b.out, iters, nullptr);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  return double(blocks) * 8 * iters * kTiles * 256 / (ms / 5) / 1e9;
}

template <int K>
bool report(const Buffers& b, int warps_per_sm) {
  std::vector<uint32_t> base(kTiles * 32 * 8), other(base.size());
  bool exact = true;
  auto same = [&](const char* name, double g) {
    const bool eq = other == base;
    exact = exact && eq;
    printf("  K%d %-28s %5.2f  (words %s)\n", K, name, g, eq ? "bit-exact" : "DIFFER");
  };
  printf("  K%d %-28s %5.2f\n", K, "split words as B (4 MMA)", rate<K, kSplitAsB>(b, base, warps_per_sm));
  same("split words as A, n8 (2 MMA)", rate<K, kSplitAsA>(b, other, warps_per_sm));
  printf("  K%d %-28s %5.2f %5.2f %5.2f\n", K, "  ... 1 / 2 / 4 route blocks", rate<K, kSplitAsA, 1>(b, other, warps_per_sm),
         rate<K, kSplitAsA, 2>(b, other, warps_per_sm), rate<K, kSplitAsA, 4>(b, other, warps_per_sm));
  printf("  K%d %-28s %5.2f %5.2f %5.2f\n", K, "merged as A, 1 / 2 / 4 blocks", rate<K, kMergedAsA, 1>(b, other, warps_per_sm),
         rate<K, kMergedAsA, 2>(b, other, warps_per_sm), rate<K, kMergedAsA, 4>(b, other, warps_per_sm));
  printf("  K%d %-28s %5.2f\n", K, "merged as B (2 MMA)", rate<K, kMergedAsB>(b, other, warps_per_sm));
  printf("  K%d %-28s %5.2f\n", K, "decode only", rate<K, kDecodeOnly>(b, other, warps_per_sm));
  printf("  K%d %-28s %5.2f\n", K, "MMA only (4 per tile)", rate<K, kMmaOnly>(b, other, warps_per_sm));
  same("DFMA, constant-high pair", rate<K, kDfmaPair>(b, other, warps_per_sm));
  same("I2F.F64.U16 half + DFMA", rate<K, kI2fHalfDfma>(b, other, warps_per_sm));
  same("I2F.F64.U32 + DFMA", rate<K, kI2fWordDfma>(b, other, warps_per_sm));
  if (K == 3) {
    same("5 states on IMAD, n8 (2 MMA)", rate<K, kK3ImadStates>(b, other, warps_per_sm));
    same("3 states on IMAD, n8 (2 MMA)", rate<K, kK3ImadSome>(b, other, warps_per_sm));
  }
  return exact;
}

int main() {
  const int n = kTiles * 8 * 8;
  std::vector<uint32_t> host(n);
  srand(7);
  for (auto& v : host) v = (uint32_t(rand()) << 16) ^ uint32_t(rand());
  Buffers b;
  cudaMalloc(&b.src, n * 4);
  cudaMalloc(&b.dump, kTiles * 32 * 8 * 4);
  cudaMalloc(&b.out, 132 * 8 * 256 * 4);
  cudaMemcpy(b.src, host.data(), n * 4, cudaMemcpyHostToDevice);
  bool exact = true;
  for (int warps : {32, 64}) {
    printf("%d warps per SM, G weights / ms:\n", warps);
    exact = report<4>(b, warps) && exact;
    exact = report<3>(b, warps) && exact;
  }
  const cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess && exact ? 0 : 1;
}
