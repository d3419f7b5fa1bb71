// The GEMM kernels of the library, by codebook, tile family and K-set, as the launch sequence takes them.
//
// The library is linked from translation units compiled in parallel (trellis_cli/kernel/build.py): the
// host unit trellis_moe.cu (argument checks, launch sequence, route pack, rotation, activation, top-k sum)
// and one gemm_unit.cu per codebook and tile family, holding that family's FC1 and FC2 kernels. Each GEMM
// unit fills its entries of g_gemm_kernels when the library is loaded; an entry left null is a unit the
// library was linked without (trellis_moe_forward refuses that call).
#pragma once
#include <cuda_runtime.h>

#include "abi.h"
#include "fc1_split.cuh"

namespace trellis {

// The FC1 and FC2 kernels of one tile size, with their launch shapes.
struct GemmKernels {
  void (*fc1)(TrellisMoeArgs, Fc1Pieces);
  void (*fc2)(TrellisMoeArgs);
  int fc1_threads, fc1_smem;
  dim3 fc2_grid;
  int fc2_threads, fc2_smem;
};

// Which kernels serve a call's work tiles: mma.sync with 16, 32 or 128 rows, or Hopper wgmma (sm_90a
// builds, 128-row tiles: tile_kernels.cuh gemms_on_wgmma).
enum TileFamily { kMma16, kMma32, kMma128, kWgmma, kTileFamilies };
constexpr int kCodebooks = 3;  // TRELLIS_CB_3INST, TRELLIS_CB_MCG, TRELLIS_CB_MUL1
enum KSet { kAllK, kOnlyK3K4, kKSets };  // tile_kernels.cuh only_k3_k4: the FAST kernels

using GemmKernelsFor = GemmKernels (*)(const TrellisMoeArgs&);

// [codebook][family][K-set]; defined in trellis_moe.cu, filled by the GEMM units at load time.
extern GemmKernelsFor g_gemm_kernels[kCodebooks][kTileFamilies][kKSets];

}  // namespace trellis
