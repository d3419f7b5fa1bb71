// C ABI of the fused mixed-K trellis MoE kernel library.
//
// One call computes one MoE layer on one tensor-parallel rank from the route-pack layout
// (trellis_cli/repack/format.py) directly. Everything a call needs travels in TrellisMoeArgs, mirrored
// field by field in trellis_cli/kernel/abi.py: change both together and bump TRELLIS_ABI_VERSION.
#pragma once
#include <stdint.h>

#define TRELLIS_ABI_VERSION 6
#define TRELLIS_MAX_TIERS 8

// Codebook ids (format.py CODEBOOK_IDS).
#define TRELLIS_CB_3INST 0
#define TRELLIS_CB_MCG 1
#define TRELLIS_CB_MUL1 2

// Activation / output dtypes.
#define TRELLIS_DT_FP32 0
#define TRELLIS_DT_FP16 1
#define TRELLIS_DT_BF16 2

#ifdef __cplusplus
extern "C" {
#endif

typedef struct TrellisMoeArgs {
  // Layer weights (device pointers), route-pack layout.
  const void* tier_trellis[TRELLIS_MAX_TIERS];  // int16 [E_t, 3, (H/16)*(I/16), 16*K_t]
  const void* global_to_combined;               // int32 [E]
  const void* descriptors;                      // int32 [E_c]: (tier << 8) | local, -1 = skip
  const void* rot_intermediate;                 // fp16 [E_c, 3, I]: gate svh | up svh | down suh
  const void* gate_suh;                         // fp16 [E_c or 1, H]
  const void* up_suh;                           // fp16 [E_c or 1, H]
  const void* down_svh;                         // fp16 [E_c or 1, H]
  // One call.
  const void* x;             // fp16 | bf16 [M, H]
  const void* topk_ids;      // int32 | int64 [M, top_k], global expert ids
  const void* topk_weights;  // fp32 [M, top_k]
  void* out;                 // fp32 | fp16 | bf16 [M, H]
  // Workspace (device pointers; sizes from trellis_cli/kernel/plan.py).
  void* tile_count;   // int32 [1]
  void* tile_expert;  // int32 [tile_capacity]
  void* tile_start;   // int32 [tile_capacity]
  void* tile_rows;    // int32 [tile_capacity]
  void* slot_route;   // int32 [slot_capacity]
  void* partial;      // fp32 [k_split * fc1_tail_split, slot_capacity, 2*I]
  void* xrot;         // fp16 [slot_capacity, 2, H]: rotated gate and up inputs per route
  void* act;          // fp16 [slot_capacity, I]
  void* route_out;    // fp32 [M*top_k, H]
  void* handover;     // int32 [3, tile_capacity]: per-tile hand-over counters (16-, 32-, narrow 128-row tiles)
                      // (handover.cuh); zero when allocated, and zero again after every call
  // Scalars.
  int32_t tier_k[TRELLIS_MAX_TIERS];
  int32_t tier_size[TRELLIS_MAX_TIERS];
  int32_t abi_version;
  int32_t num_tiers;
  int32_t hidden;
  int32_t intermediate;
  int32_t num_experts;   // E
  int32_t num_combined;  // E_c
  int32_t codebook;
  int32_t gate_suh_shared;  // 1: one row for every expert
  int32_t up_suh_shared;
  int32_t down_svh_shared;
  int32_t m;
  int32_t top_k;
  int32_t ids_int64;
  int32_t x_dtype;
  int32_t out_dtype;
  int32_t m_tile;  // 16, 32 or 128 rows per work tile
  int32_t k_split;  // FC1 split of H into k_split ranges (divides H/128)
  int32_t slot_capacity;
  int32_t tile_capacity;
  // 1: direct small-M mode: no route pack, work tile t is route t (one row, slot t), and FC1 rotates its
  // own input rows (no rotation launch). Needs m_tile 16, slot and tile capacity >= m * top_k, and at
  // most kDirectMaxChunks 128-column chunks of H per FC1 range.
  int32_t direct;
  // FC1 cuts the H ranges of its last half wave of items this many times finer (1, 2 or 4; dividing each
  // range), where two or more of its CTAs share an SM (fc1_split.cuh); the partial sums hold k_split *
  // fc1_tail_split planes. Chosen by trellis_cli/kernel/plan.py choose_fc1_tail_split.
  int32_t fc1_tail_split;
} TrellisMoeArgs;

int trellis_abi_version(void);
// 1 when large work tiles (m_tile 128) run on Hopper wgmma (an sm_90a build), 0 for mma.sync.
int trellis_has_wgmma(void);
int trellis_args_size(void);
// 0 on success; otherwise a CUDA error code or -1 (bad arguments): see trellis_last_error().
int trellis_moe_forward(const TrellisMoeArgs* args, void* stream);
const char* trellis_last_error(void);

#ifdef __cplusplus
}
#endif
