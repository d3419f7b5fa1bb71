// Direct mode's hand-over from FC1 to the activation to FC2 per route, instead of per grid.
//
// A grid-wide wait makes every route wait for FC1's last CTA. From two tokens on, FC1's grid lists each
// route's pieces together, so the routes whose pieces were placed first finish first, and their
// activation and FC2 run while FC1 still works on the others (docs/performance.md, runs 149-153).
// Each phase counts, per route, the work it has stored:
//   FC1 piece stored     -> fc1_done[route] += 1    the route's activation waits for items x k_split
//   activation warp      -> act_done[route] += 1    the route's FC2 CTAs wait for I / 128
//   FC2 CTA past its wait -> fc2_passed[route] += 1  the route's last FC2 CTA sets all three back to zero
// so every counter is zero again when a call ends (the host clears them after a call that skipped a
// phase). A phase is launched only once every CTA of the phase before it is resident (programmatic
// dependent launch), so whatever a CTA waits for is already running: the waits cannot deadlock.
// At one token (8 routes) the routes placed last leave too little FC2 work to spread over the GPU, and
// the grid-wide hand-over measured as fast: it stays there.
#pragma once
#include <stdint.h>

#include "abi.h"

namespace trellis {

__host__ __device__ inline bool routed_handover(const TrellisMoeArgs& a) { return a.direct && a.m > 1; }

struct DirectSync {
  int* fc1_done;
  int* act_done;
  int* fc2_passed;
};
__device__ __forceinline__ DirectSync direct_sync(const TrellisMoeArgs& a) {
  int* base = static_cast<int*>(a.direct_sync);
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

// A counter that has not reached its target after this long means the protocol is broken: stop the
// kernel with an error rather than hang the GPU.
constexpr unsigned long long kWaitLimitNs = 10'000'000'000ull;

__device__ __forceinline__ unsigned long long wait_clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Until `counter` reaches `target`. Warp-wide (every lane calls it, the loop's exit is warp-uniform, so
// the warp stays converged for the shuffles after it) or by one thread before a CTA barrier.
template <bool kWarp>
__device__ __forceinline__ void wait_count(const int* counter, int target) {
  const unsigned long long start = wait_clock_ns();
  unsigned sleep_ns = 32;
  for (;;) {
    const bool reached = load_acquire(counter) >= target;
    if (kWarp ? __all_sync(0xffffffffu, reached) : reached) return;
    if (wait_clock_ns() - start > kWaitLimitNs) __trap();
    __nanosleep(sleep_ns);
    if (sleep_ns < 256) sleep_ns *= 2;
  }
}

}  // namespace trellis
