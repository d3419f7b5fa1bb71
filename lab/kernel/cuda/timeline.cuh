// The timeline lab build only (-DTRELLIS_LAB -DTRELLIS_TIMELINE, one translation unit: single_tu.cu;
// lab/kernel/lab.py): when each CTA of each phase started, returned from its wait on the previous
// kernel, and ended, read with %globaltimer (ns) and exported by trellis_timeline_read. The stamps are
// placed by hooks.patch; without -DTRELLIS_TIMELINE (the plain lab build) each compiles to nothing.
#pragma once
#include <stdint.h>

#if defined(TRELLIS_TIMELINE) && !defined(TRELLIS_LAB)
#error "the timeline is a lab build: compile it with -DTRELLIS_LAB (lab/kernel/lab.py)"
#endif

namespace trellis {

enum TimelinePhase { kTlPack, kTlRotate, kTlFc1, kTlAct, kTlFc2, kTlSum, kTlPhases };

// The GPU's global clock in ns.
__device__ __forceinline__ unsigned long long timeline_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

#ifdef TRELLIS_TIMELINE
constexpr int kTlMaxCtas = 16384;
constexpr int kTlFields = 8;
// [phase][cta]: start (thread 0), waited (thread 0, after griddepcontrol.wait), end (latest warp), SM id,
// then up to 4 marks (thread 0, timeline_mark) at points each kernel names.
__device__ unsigned long long g_timeline[kTlPhases][kTlMaxCtas][kTlFields];
__device__ __forceinline__ int timeline_cta() {
  const int cta = blockIdx.x + blockIdx.y * gridDim.x;
  return cta < kTlMaxCtas ? cta : kTlMaxCtas - 1;
}
__device__ __forceinline__ int& timeline_phase() {
  __shared__ int phase;
  return phase;
}
struct TimelineScope {
  int phase_;
  __device__ explicit TimelineScope(int phase) : phase_(phase) {
    if (threadIdx.x == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
      timeline_phase() = phase;
      g_timeline[phase][timeline_cta()][0] = timeline_ns();
      g_timeline[phase][timeline_cta()][3] = sm;
    }
  }
  __device__ ~TimelineScope() {
    if ((threadIdx.x & 31) == 0) atomicMax(&g_timeline[phase_][timeline_cta()][2], timeline_ns());
  }
};
#define TRELLIS_TIMELINE_SCOPE(phase) const TimelineScope timeline_scope_(phase)
// Thread 0 wrote the phase itself (TimelineScope), so it reads it back without a barrier.
__device__ __forceinline__ void timeline_waited() {
  if (threadIdx.x == 0) g_timeline[timeline_phase()][timeline_cta()][1] = timeline_ns();
}
__device__ __forceinline__ void timeline_mark(int i) {
  if (threadIdx.x == 0) g_timeline[timeline_phase()][timeline_cta()][4 + i] = timeline_ns();
}
#else
#define TRELLIS_TIMELINE_SCOPE(phase) ((void)0)
__device__ __forceinline__ void timeline_waited() {}
__device__ __forceinline__ void timeline_mark(int) {}
#endif

}  // namespace trellis
