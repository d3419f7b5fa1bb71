// The decode probes' workload: kTiles random 16x16 trellis tiles held in shared memory, which every warp
// walks from its own first tile, and stand-ins for one block of 8 routes' activation fragments.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include <vector>

#include "../../../kernels/decode.cuh"

constexpr int kTiles = 64;

// The lane's words of staged tile `tile` (s_w: kTiles tiles of 8K words); warp_tile: the tile a warp
// takes at step kt.
template <int K>
__device__ __forceinline__ trellis::TileWords staged_tile(const uint32_t* s_w, int tile,
                                                         const trellis::LaneWindow& win) {
  trellis::TileWords t;
  t.u0 = s_w[tile * 8 * K + win.w0];
  t.u1 = s_w[tile * 8 * K + win.w1];
  t.u2 = 0;
  return t;
}
__device__ __forceinline__ int warp_tile(int kt, int warp) { return (kt + warp) & (kTiles - 1); }

// Route operand stand-ins (fp16 pairs, different per lane, never zero).
__device__ __forceinline__ void route_stand_ins(int lane, uint32_t rows[4]) {
  rows[0] = 0x3C003C00u ^ lane;
  rows[1] = 0x3C00BC00u;
  rows[2] = 0xBC003C00u + lane;
  rows[3] = 0x38003800u;
}

// Random tile words on the device, the same in every run: kTiles tiles of up to 8K words (K <= 8).
inline uint32_t* random_tile_words() {
  std::vector<uint32_t> host(kTiles * 8 * 8);
  srand(11);
  for (auto& v : host) v = (uint32_t(rand()) << 16) ^ uint32_t(rand());
  uint32_t* words = nullptr;
  cudaMalloc(&words, host.size() * 4);
  cudaMemcpy(words, host.data(), host.size() * 4, cudaMemcpyHostToDevice);
  return words;
}

// Mean milliseconds of `reps` calls of `launch` (the caller warms up first).
template <typename Launch>
float mean_launch_ms(Launch&& launch, int reps = 5) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int rep = 0; rep < reps; ++rep) launch();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / reps;
}
