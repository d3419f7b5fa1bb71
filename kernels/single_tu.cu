// The whole library of one codebook (-DTRELLIS_UNIT_CODEBOOK=id) as one translation unit, for diagnostic
// builds whose device state every kernel must share: with -DTRELLIS_TIMELINE each unit would hold its own
// g_timeline (timeline.cuh). trellis_cli/kernel/build.py never compiles it; scripts/timeline.py does.
#include "trellis_moe.cu"
#include "gemm_unit.cu"
