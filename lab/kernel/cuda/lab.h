// The lab build of the kernel library (-DTRELLIS_LAB; lab/kernel/lab.py builds and loads it). It compiles the
// product's kernels/ with lab/kernel/cuda/hooks.patch applied and this directory's files added
// (lab/kernel/sources.py); the product's sources include none of them.
// TrellisMoeArgs then ends with `lab_flags`, which skip phases of a call (timing variants: the results
// are then meaningless) or force a launch shape (comparisons and tests: the results are unchanged), and
// the library exports trellis_lab_build. The timeline (timeline.cuh) is a lab build too.
#pragma once
#include "abi.h"

#define TRELLIS_LAB_SKIP_FC1 1
#define TRELLIS_LAB_SKIP_ACT 2
#define TRELLIS_LAB_SKIP_FC2 4
#define TRELLIS_LAB_SKIP_SUM 8
#define TRELLIS_LAB_SKIP_ROTATE 16
#define TRELLIS_LAB_NO_PDL 32  // launch every phase fully serialized
// FC2 CTAs of small tiles take the most output blocks allowed, whatever the grid (gemm_unit.cu fc2_span).
#define TRELLIS_LAB_FC2_WIDE_SPAN 64
// 128-row tiles on Hopper: the narrow wgmma kernels (passes of 64 routes, two CTAs per SM), or the wide
// ones, whatever the routes per expert (tile_kernels.cuh narrow_wgmma_tiles).
#define TRELLIS_LAB_WGMMA_NARROW 256
#define TRELLIS_LAB_WGMMA_WIDE 512

namespace trellis {

// Whether the call sets any of `flags` (false without -DTRELLIS_LAB).
__host__ __device__ __forceinline__ bool lab_flag(const TrellisMoeArgs& a, int flags) {
#ifdef TRELLIS_LAB
  return (a.lab_flags & flags) != 0;
#else
  (void)a;
  (void)flags;
  return false;
#endif
}

}  // namespace trellis

#ifdef TRELLIS_LAB
extern "C" {
// 1: the library is a lab build (its arguments end with lab_flags).
int trellis_lab_build(void);
#ifdef TRELLIS_TIMELINE
// Copies the timeline of the calls since the last read into `host` and clears it (timeline.cuh).
int trellis_timeline_read(unsigned long long* host);
#endif
}
#endif
