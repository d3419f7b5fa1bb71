// The whole library of one codebook (-DTRELLIS_UNIT_CODEBOOK=id) as one translation unit, for lab builds
// whose device state every kernel must share: with -DTRELLIS_TIMELINE each unit would hold its own
// g_timeline (timeline.cuh). lab/kernel/lab.py builds it as the timeline build's one unit
// (build.BuildExtension.single_source).
#include "trellis_moe.cu"
#include "gemm_unit.cu"
