// The hand-over from FC1 to the activation to FC2 per work tile, instead of per grid (16- and 32-row
// tiles, direct mode from two tokens on, and 128-row tiles on the narrow wgmma kernels).
//
// A grid-wide wait makes every tile wait for FC1's last CTA, and FC1's last wave leaves SMs idle (of two
// CTAs sharing an SM the first placed runs ahead). FC1's pieces are listed tile by tile, so tiles finish
// FC1 in turn, and each phase counts, per tile, the work it has stored:
//   FC1 piece stored      -> fc1_done[tile] += 1    the tile's activation waits for items x planes
//   activation warp       -> act_done[tile] += 1    the tile's FC2 CTAs wait for row steps x I / 128
//   FC2 CTA past its wait -> fc2_passed[tile] += 1  the tile's last FC2 CTA sets all three back to zero
// so a tile's activation and FC2 run while FC1 still works on later tiles (glm52-tp4 on H200: M = 2-6
// -2 to -11 %, M=8 -2.6 %). Every counter is zero again when a call ends. A phase is launched only once every
// CTA of the phase before it is resident (programmatic dependent launch), so whatever a CTA waits for is
// already running: the waits cannot deadlock.
// Not at one token in direct mode: there the routes placed last leave too little FC2 work to spread over
// the GPU, and one grid-wide hand-over measured faster. Not for the wide wgmma kernels (one CTA per SM, no
// second CTA to run ahead) nor the mma.sync kernels of 128-row tiles.
#pragma once
#include <stdint.h>

#include "abi.h"
#include "tile_kernels.cuh"

namespace trellis {

__host__ __device__ inline bool tile_handover(const TrellisMoeArgs& a) {
  return (a.m_tile <= 32 && (!a.direct || a.m > 1)) || narrow_wgmma_tiles(a);
}

// Rows per activation warp step over a tile (the activation grid's y): one in direct mode (one row per
// tile), 8 for 16-row tiles, 16 for 32- and 128-row tiles (two rows per warp step).
__host__ __device__ inline int activation_row_steps(const TrellisMoeArgs& a) {
  return a.direct ? 1 : a.m_tile == 16 ? 8 : 16;
}

struct Handover {
  int* fc1_done;
  int* act_done;
  int* fc2_passed;
};
__device__ __forceinline__ Handover handover(const TrellisMoeArgs& a) {
  int* base = static_cast<int*>(a.handover);
  return {base, base + a.tile_capacity, base + 2 * a.tile_capacity};
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One thread, after a barrier that orders its group's stores before it: count the group's work stored.
__device__ __forceinline__ void count_done(int* counter) {
  __threadfence();
  atomicAdd(counter, 1);
}

// The GPU's global clock in ns: the waits' time limit.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// A counter that has not reached its target after this long means the protocol is broken: stop the
// kernel with an error rather than hang the GPU.
constexpr unsigned long long kWaitLimitNs = 10'000'000'000ull;

// Until `counter` reaches `target`. Warp-wide (every lane calls it, the loop's exit is warp-uniform, so
// the warp stays converged for the shuffles after it) or by one thread before a CTA barrier.
template <bool kWarp>
__device__ __forceinline__ void wait_count(const int* counter, int target) {
  const unsigned long long start = global_ns();
  unsigned sleep_ns = 32;
  for (;;) {
    const bool reached = load_acquire(counter) >= target;
    if (kWarp ? __all_sync(0xffffffffu, reached) : reached) return;
    if (global_ns() - start > kWaitLimitNs) __trap();
    __nanosleep(sleep_ns);
    if (sleep_ns < 256) sleep_ns *= 2;
  }
}

// FC2, thread 0 of a CTA of `tile`, one of the tile's `ctas`: wait for the tile's activation, then count
// the CTA past; the tile's last one puts the tile's counters back to zero.
__device__ __forceinline__ void fc2_takes_tile(const TrellisMoeArgs& a, int tile, int ctas) {
  const Handover sync = handover(a);
  wait_count<false>(sync.act_done + tile, activation_row_steps(a) * (a.intermediate >> 7));
  if (atomicAdd(sync.fc2_passed + tile, 1) == ctas - 1) {
    sync.fc1_done[tile] = 0;
    sync.act_done[tile] = 0;
    sync.fc2_passed[tile] = 0;
  }
}

}  // namespace trellis
