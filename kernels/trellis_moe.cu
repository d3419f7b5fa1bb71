// Host entry of the fused mixed-K trellis MoE: argument checks and the launch sequence.
//
// One call = route pack -> input rotation -> FC1 (gate, up) -> activation -> FC2 (down, output rotation,
// router weight) -> fixed-order top-k sum; in direct small-M mode FC1 -> activation -> FC2 -> sum. Tiles of
// 16 and 32 rows, and 128-row tiles on the narrow wgmma kernels, go from FC1 to the activation to FC2 one
// by one (handover.cuh). All run on the caller's stream with no host synchronisation, so a whole call can
// be captured in a CUDA graph. Every tier's K and size are launch scalars: one compiled object serves any
// partition of any layer.
//
// This is the library's host unit; the FC1 and FC2 kernels come from the GEMM units linked with it
// (gemm_table.h, gemm_unit.cu).
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>

#include "abi.h"
#include "activation.cuh"
#include "expert_gemm.cuh"
#include "gemm_table.h"
#include "launch.cuh"
#include "occupancy.cuh"
#include "rotation_launch.cuh"
#include "route_pack_kernels.cuh"

namespace {

using trellis::ctas_per_sm;
using trellis::GemmKernels;
using trellis::sm_limits;
using trellis::SmLimits;

char g_error[512] = "";

// The launch a failure is reported against: its kernel, threads and dynamic shared memory, so that a launch
// the device refuses names the kernel and what it asked for.
struct LaunchNote {
  const char* kernel = "";
  int threads = 0, smem = 0;
};
LaunchNote g_last_launch;

void note_launch(const char* kernel, int threads, int smem) { g_last_launch = {kernel, threads, smem}; }

int fail(const char* message) {
  snprintf(g_error, sizeof(g_error), "%s", message);
  return -1;
}

bool is_pow2_multiple(int v, int m) { return v > 0 && v % m == 0; }

int check_args(const TrellisMoeArgs& a) {
  if (a.abi_version != TRELLIS_ABI_VERSION) return fail("abi_version mismatch between caller and library");
  if (a.num_tiers < 1 || a.num_tiers > TRELLIS_MAX_TIERS) return fail("num_tiers must be 1..8");
  if (!is_pow2_multiple(a.hidden, 128) || !is_pow2_multiple(a.intermediate, 128))
    return fail("hidden and intermediate must be positive multiples of 128");
  if (a.intermediate > 32 * 128) return fail("intermediate per rank must be <= 4096");
  if (a.codebook < 0 || a.codebook > 2) return fail("codebook id must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  if (a.m_tile != 16 && a.m_tile != 32 && a.m_tile != 128) return fail("m_tile must be 16, 32 or 128");
  if (a.k_split < 1 || (a.hidden / 128) % a.k_split != 0) return fail("k_split must divide hidden/128");
  if ((a.fc1_tail_split != 1 && a.fc1_tail_split != 2 && a.fc1_tail_split != 4) ||
      (a.hidden / 128 / a.k_split) % a.fc1_tail_split != 0)
    return fail("fc1_tail_split must be 1, 2 or 4 and divide each k_split range of hidden/128");
  if (a.m < 0 || a.top_k < 1) return fail("m must be >= 0 and top_k >= 1");
  if (a.num_combined < 1 || a.num_combined > TRELLIS_MAX_TIERS * 256) return fail("num_combined out of range");
  if (a.x_dtype != TRELLIS_DT_FP16 && a.x_dtype != TRELLIS_DT_BF16) return fail("x must be fp16 or bf16");
  if (a.out_dtype < TRELLIS_DT_FP32 || a.out_dtype > TRELLIS_DT_BF16) return fail("bad out dtype");
  int total = 0;
  for (int t = 0; t < a.num_tiers; ++t) {
    if (a.tier_k[t] < 1 || a.tier_k[t] > 8) return fail("tier K must be 1..8");
    if (a.tier_size[t] < 0 || a.tier_size[t] > 256) return fail("tier size must be 0..256");
    if (a.tier_size[t] > 0 && a.tier_trellis[t] == nullptr) return fail("missing tier trellis pointer");
    total += a.tier_size[t];
  }
  if (total != a.num_combined) return fail("tier sizes do not add up to num_combined");
  if (trellis::tile_handover(a) && a.handover == nullptr) return fail("missing handover workspace");
  const long long numel = 1LL * a.m * a.top_k;
  if (numel > (1LL << 30)) return fail("m * top_k too large");
  if (a.direct) {  // one tile and one slot per route
    if (a.m_tile != 16) return fail("direct mode needs m_tile 16");
    if ((a.hidden / 128) / a.k_split > trellis::kDirectMaxChunks) return fail("direct mode: too few k_split ranges");
    if (a.slot_capacity < numel || a.tile_capacity < numel) return fail("direct mode: capacities below m*top_k");
    return 0;
  }
  const long long min_slots = numel + 15LL * (numel < a.num_combined ? numel : a.num_combined);
  if (a.slot_capacity < min_slots) return fail("slot_capacity below m*top_k + 15*min(m*top_k, E_c)");
  const long long min_tiles = numel / a.m_tile + (numel < a.num_combined ? numel : a.num_combined);
  if (a.tile_capacity < min_tiles) return fail("tile_capacity below m*top_k/m_tile + min(m*top_k, E_c)");
  if (1LL * a.tile_capacity * trellis::fc1_items_per_tile(a) * (a.hidden / 128) >= (1LL << 31))
    return fail("m * top_k too large: FC1's pieces exceed 2^31");
  return 0;
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Programmatic dependent launch needs sm_90; older GPUs run the same kernels fully serialized.
bool device_has_pdl() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

// Dynamic shared memory for a launch of `blocks` CTAs that fits on the GPU in one wave: enough that no SM
// takes more than ceil(blocks / SMs) of them. The block scheduler otherwise fills some SMs to the
// kernel's limit while others get fewer, and the call waits for the fullest SM (FC2 at M=1: 384 CTAs put 4
// on some SMs, which ended last; at most 3 per SM moved FC2's end from 37.3 to 34.1 us). Returns `smem` when
// it cannot or need not help.
int even_wave_smem(void (*kernel)(TrellisMoeArgs), int blocks, int threads, int smem) {
  SmLimits l;
  if (!sm_limits(l) || blocks > (l.threads / threads) * l.sms) return smem;  // no occupancy query for large grids
  const int per_sm = ctas_per_sm(kernel, threads, smem);
  if (blocks > per_sm * l.sms) return smem;
  const int cap = (blocks + l.sms - 1) / l.sms;
  if (cap >= per_sm) return smem;
  const int padded = ((l.smem / (cap + 1) - l.reserved) / 128 + 1) * 128;  // cap + 1 CTAs no longer fit
  if (padded <= smem || padded > l.optin || allow_smem(kernel, padded) != cudaSuccess) return smem;
  return ctas_per_sm(kernel, threads, padded) == cap ? padded : smem;
}

// FC1's cut (fc1_split.cuh): the tail is the items of half a wave of the CTAs that fit at once (of the
// plan's k_split ranges each), in whole tiles, cut as the plan allows where two or more CTAs share an SM
// (small and mid tiles, the narrow wgmma kernels). A kernel of one CTA per SM pays each piece's pipeline
// fill alone: the wide wgmma kernels cut in 2 took 2 % longer at M=512.
trellis::Fc1Pieces fc1_pieces(const TrellisMoeArgs& a, void (*kernel)(TrellisMoeArgs, trellis::Fc1Pieces),
                              int threads, int smem) {
  const int per_tile = trellis::fc1_items_per_tile(a);
  SmLimits l;
  if (a.direct || !sm_limits(l)) return {0, 1};
  const int per_sm = ctas_per_sm(kernel, threads, smem);
  const int half_wave = (l.sms * (per_sm > 0 ? per_sm : 1) + 1) / 2;
  const int items = (half_wave + a.k_split - 1) / a.k_split;
  return {(items + per_tile - 1) / per_tile * per_tile, per_sm >= 2 ? a.fc1_tail_split : 1};
}

// One CTA per piece: direct mode (items, ranges); otherwise every range of every item the tiles can hold,
// and the tail's finer pieces.
dim3 fc1_grid(const TrellisMoeArgs& a, const trellis::Fc1Pieces& p) {
  const int items = a.tile_capacity * trellis::fc1_items_per_tile(a);
  if (a.direct) return trellis::tile_handover(a) ? dim3(a.k_split, items) : dim3(items, a.k_split);
  return dim3(items * a.k_split + p.tail_items * a.k_split * (p.tail_split - 1));
}

cudaError_t launch_gemms(const TrellisMoeArgs& a, const GemmKernels& k, cudaStream_t stream, bool pdl) {
  using namespace trellis;
  cudaError_t err = cudaSuccess;
  note_launch("FC1", k.fc1_threads, k.fc1_smem);
  if ((err = allow_smem(k.fc1, k.fc1_smem)) != cudaSuccess) return err;
  note_launch("FC2", k.fc2_threads, k.fc2_smem);
  if ((err = allow_smem(k.fc2, k.fc2_smem)) != cudaSuccess) return err;
  const int tiles = a.tile_capacity;
  // Direct mode: FC1 rotates its own rows and is the call's first kernel, so it launches fully serialized.
  if (!a.direct) {
    const RotationLaunch rotation = rotation_for(a, tiles);
    note_launch("input rotation", 256, 0);
    err = launch(rotation.kernel, rotation.grid, 256, 0, stream, pdl, a);
  }
  const Fc1Pieces pieces = fc1_pieces(a, k.fc1, k.fc1_threads, k.fc1_smem);
  if (err == cudaSuccess) {
    note_launch("FC1", k.fc1_threads, k.fc1_smem);
    err = launch(k.fc1, fc1_grid(a, pieces), k.fc1_threads, k.fc1_smem, stream, pdl && !a.direct, a, pieces);
  }
  if (err == cudaSuccess) {
    const int act_blocks = a.intermediate / 128, act_warps = act_blocks < kActWarps ? act_blocks : kActWarps;
    const dim3 act_grid(tiles, activation_row_steps(a), (act_blocks + act_warps - 1) / act_warps);
    note_launch("activation", act_warps * 32, 0);
    err = launch(activation_for(a), act_grid, act_warps * 32, 0, stream, pdl, a, pieces);
  }
  if (err == cudaSuccess) {
    const int blocks = static_cast<int>(k.fc2_grid.x * k.fc2_grid.y);
    const int fc2_smem = even_wave_smem(k.fc2, blocks, k.fc2_threads, k.fc2_smem);
    note_launch("FC2", k.fc2_threads, fc2_smem);
    if ((err = allow_smem(k.fc2, fc2_smem)) == cudaSuccess)
      err = launch(k.fc2, k.fc2_grid, k.fc2_threads, fc2_smem, stream, pdl, a);
  }
  return err;
}

// The tile family whose kernels serve this call's work tiles: 128-row tiles run on wgmma where
// gemms_on_wgmma says so (sm_90a builds), on mma.sync otherwise.
trellis::TileFamily tile_family(const TrellisMoeArgs& a) {
  switch (a.m_tile) {
    case 16: return trellis::kMma16;
    case 32: return trellis::kMma32;
    default: return trellis::gemms_on_wgmma(a) ? trellis::kWgmma : trellis::kMma128;
  }
}

const char* const kCodebookNames[trellis::kCodebooks] = {"3inst", "mcg", "mul1"};

}  // namespace

namespace trellis {
GemmKernelsFor g_gemm_kernels[kCodebooks][kTileFamilies][kKSets] = {};
}  // namespace trellis

extern "C" int trellis_abi_version(void) { return TRELLIS_ABI_VERSION; }

extern "C" int trellis_has_wgmma(void) {
#ifdef TRELLIS_WGMMA
  return 1;
#else
  return 0;
#endif
}

extern "C" int trellis_args_size(void) { return static_cast<int>(sizeof(TrellisMoeArgs)); }

extern "C" const char* trellis_last_error(void) { return g_error; }

extern "C" int trellis_moe_forward(const TrellisMoeArgs* args, void* stream_handle) {
  using namespace trellis;
  if (args == nullptr) return fail("null args");
  const TrellisMoeArgs a = *args;
  if (int rc = check_args(a)) return rc;
  if (a.m == 0) return 0;
  const GemmKernelsFor gemm_kernels =
      g_gemm_kernels[a.codebook][tile_family(a)][only_k3_k4(a) ? kOnlyK3K4 : kAllK];
  if (gemm_kernels == nullptr) {
    snprintf(g_error, sizeof(g_error), "this kernel library was linked without the %s codebook's %s kernels for "
             "these tiles (trellis_cli/kernel/build.py builds one library per codebook and kernel set)",
             kCodebookNames[a.codebook], only_k3_k4(a) ? "K3/K4" : "all-K");
    return -1;
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  cudaGetLastError();  // a stale error from unrelated work must not be blamed on this call
  const bool pdl = device_has_pdl();
  cudaError_t err = cudaSuccess;
  if (!a.direct) {
    // The call's first kernel, launched without PDL: it starts once the previous call has finished.
    const int numel = a.m * a.top_k, per_expert = a.num_combined * static_cast<int>(sizeof(int));
    note_launch("route pack", kPackThreads, (numel >= kWidePackFrom ? 4 : 3) * per_expert);
    if (numel >= kWidePackFrom) {
      const int ctas = (numel + kPackThreads - 1) / kPackThreads;
      route_count_kernel<<<ctas, kPackThreads, per_expert, stream>>>(a);
      err = cudaGetLastError();
      if (err == cudaSuccess) err = launch(route_scatter_kernel, ctas, kPackThreads, 4 * per_expert, stream, pdl, a);
    } else {
      route_pack_kernel<<<1, kPackThreads, 3 * per_expert, stream>>>(a);
      err = cudaGetLastError();
    }
  }
  if (err == cudaSuccess) err = launch_gemms(a, gemm_kernels(a), stream, pdl);
  if (err == cudaSuccess) {
    dim3 grid(a.m, (a.hidden + 4 * kSumThreads - 1) / (4 * kSumThreads));
    note_launch("top-k sum", kSumThreads, 0);
    err = launch(topk_sum_for(a), grid, kSumThreads, 0, stream, pdl, a);
  }
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof(g_error), "CUDA refused the %s launch (%d threads, %d bytes of dynamic shared memory): %s",
             g_last_launch.kernel, g_last_launch.threads, g_last_launch.smem, cudaGetErrorString(err));
    return static_cast<int>(err);
  }
  return 0;
}
