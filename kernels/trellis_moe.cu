// Host entry of the fused mixed-K trellis MoE: argument checks and the launch sequence.
//
// One call = route pack -> input rotation -> FC1 (gate, up) -> activation -> FC2 (down, output rotation,
// router weight) -> fixed-order top-k sum; in direct small-M mode FC1 -> activation -> FC2 -> sum. Tiles of
// 16 and 32 rows, and 128-row tiles on the narrow wgmma kernels, go from FC1 to the activation to FC2 one
// by one (handover.cuh). All run on the caller's stream with no host synchronisation, so a whole call can
// be captured in a CUDA graph. Every tier's K and size are launch scalars: one compiled object serves any
// partition of any layer.
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>

#include "abi.h"
#include "activation.cuh"
#include "expert_gemm.cuh"
#include "expert_wgmma.cuh"
#include "launch.cuh"
#include "route_pack.cuh"

namespace {

char g_error[512] = "";

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

// What even_wave_smem needs of a device, read once per device: it runs on every call's host path.
struct SmLimits {
  int sms = 0, threads = 0, smem = 0, reserved = 0, optin = 0;
};
bool sm_limits(SmLimits& out) {
  constexpr int kDevices = 64;
  static SmLimits cache[kDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) return false;
  SmLimits& l = cache[device];
  if (l.sms == 0) {
    SmLimits read;
    if (cudaDeviceGetAttribute(&read.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.threads, cudaDevAttrMaxThreadsPerMultiProcessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        read.sms <= 0)
      return false;
    l = read;
  }
  out = l;
  return true;
}

// CTAs of `kernel` that fit on one SM with `smem` bytes of dynamic shared memory (0 when the query fails),
// per device. Cached: even_wave_smem and fc1_pieces ask on every call's host path.
template <typename Kernel>
int ctas_per_sm(Kernel kernel, int threads, int smem) {
  struct Entry {
    const void* kernel;
    int device, threads, smem, per_sm;
  };
  constexpr int kEntries = 64;
  static Entry cache[kEntries];
  static int used = 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const void* key = reinterpret_cast<const void*>(kernel);
  for (int i = 0; i < used; ++i)
    if (cache[i].kernel == key && cache[i].device == device && cache[i].threads == threads && cache[i].smem == smem)
      return cache[i].per_sm;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) return 0;
  if (used < kEntries) {  // not locked: a racing call at worst queries again
    cache[used] = {key, device, threads, smem, per_sm};
    ++used;
  }
  return per_sm;
}

// Dynamic shared memory for a launch of `blocks` CTAs that fits on the GPU in one wave: enough that no SM
// takes more than ceil(blocks / SMs) of them. The block scheduler otherwise fills some SMs to the
// kernel's limit while others get fewer, and the call waits for the fullest SM (FC2 at M=1: 384 CTAs
// at up to 4 per SM, docs/performance.md runs 73 and 76). Returns `smem` when it cannot or need not help.
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
// fill alone: the wide wgmma kernels cut in 2 took 2 % longer at M=512 (docs/performance.md, run 91).
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

// The FC1 and FC2 kernels of one tile size, with their launch shapes.
struct GemmKernels {
  void (*fc1)(TrellisMoeArgs, trellis::Fc1Pieces);
  void (*fc2)(TrellisMoeArgs);
  int fc1_threads, fc1_smem;
  dim3 fc2_grid;
  int fc2_threads, fc2_smem;
};

// FC2's output blocks per CTA for small tiles (expert_gemm.cuh, fc2_body): the most, up to 4, that still
// leave kFc2SpanWaves waves of CTAs on the GPU, counting the tiles that uniform routing would fill (the
// tile capacity is far above them at small M); 1 in direct mode (one wave). A span needs I/128 to be a power
// of two and a multiple of the ring's stages. Only the launch shape depends on it, never a result.
// docs/performance.md, runs 99-107: 4 blocks per CTA saved 1-3 % of the call at M = 64-256.
constexpr int kFc2SpanWaves = 4, kFc2MaxSpan = 4;
template <int R, bool FAST>
int fc2_span(const TrellisMoeArgs& a, void (*kernel)(TrellisMoeArgs)) {
  const int block_chunks = a.intermediate / 128, blocks = a.hidden / 128;
  if (a.direct || !trellis::small_tile(R) || block_chunks % trellis::fc2_stages(R, FAST) != 0 ||
      (block_chunks & (block_chunks - 1)) != 0)
    return 1;
  SmLimits l;
  const bool wide = (a.debug_flags & TRELLIS_FC2_WIDE_SPAN) != 0;
  if (!wide && !sm_limits(l)) return 1;
  const int slots = wide ? 0 : l.sms * ctas_per_sm(kernel, trellis::kFc2Threads, trellis::fc2_smem_bytes(R, FAST));
  const double routes = double(a.m) * a.top_k, experts = a.num_experts > 0 ? a.num_experts : 1;
  const double touched = a.num_combined * (1.0 - pow(1.0 - 1.0 / experts, routes));
  const double tiles = std::min(touched + routes * a.num_combined / experts / a.m_tile, double(a.tile_capacity));
  int span = kFc2MaxSpan;
  while (span > 1 && (blocks % span != 0 || tiles * blocks / span < double(kFc2SpanWaves) * slots)) span /= 2;
  return span;
}

template <int CB, int R, bool FAST>
GemmKernels mma_sync_kernels(const TrellisMoeArgs& a) {
  using namespace trellis;
  const int span = fc2_span<R, FAST>(a, fc2_kernel<CB, R, FAST>);
  return {fc1_kernel<CB, R, FAST>, fc2_kernel<CB, R, FAST>, kFc1Threads, fc1_smem_bytes(R, FAST),
          dim3(a.tile_capacity, a.hidden / 128 / span), kFc2Threads, fc2_smem_bytes(R, FAST)};
}

#ifdef TRELLIS_WGMMA  // sm_90a build: large tiles run on wgmma (expert_wgmma.cuh)

template <int CB, bool FAST>
GemmKernels wgmma_kernels(const TrellisMoeArgs& a) {
  using namespace trellis;
  const dim3 fc2_grid(a.tile_capacity * fc2_wgmma_groups(a.hidden));
  if constexpr (FAST) {
    if (narrow_wgmma_tiles(a)) {  // tile_kernels.cuh
      constexpr int kSmem = wg_smem_bytes(true, kWgNarrowRows);
      return {fc1_wgmma_kernel<CB, true, kWgNarrowRows>, fc2_wgmma_kernel<CB, true, kWgNarrowRows>, kWgThreads,
              kSmem, fc2_grid, kWgThreads, kSmem};
    }
  }
  return {fc1_wgmma_kernel<CB, FAST, kWgRows>, fc2_wgmma_kernel<CB, FAST, kWgRows>, kWgThreads,
          wg_smem_bytes(FAST, kWgRows), fc2_grid, kWgThreads, wg_smem_bytes(FAST, kWgRows)};
}
#endif

cudaError_t launch_gemms(const TrellisMoeArgs& a, const GemmKernels& k, cudaStream_t stream, bool pdl) {
  using namespace trellis;
  cudaError_t err = cudaSuccess;
  if ((err = allow_smem(k.fc1, k.fc1_smem)) != cudaSuccess) return err;
  if ((err = allow_smem(k.fc2, k.fc2_smem)) != cudaSuccess) return err;
  const int tiles = a.tile_capacity;
  // Direct mode: FC1 rotates its own rows and is the call's first kernel, so it launches fully serialized.
  if (!a.direct && !(a.debug_flags & TRELLIS_SKIP_ROTATE)) {
    const RotationLaunch rotation = rotation_for(a, tiles);
    err = launch(rotation.kernel, rotation.grid, 256, 0, stream, pdl, a);
  }
  const Fc1Pieces pieces = fc1_pieces(a, k.fc1, k.fc1_threads, k.fc1_smem);
  if (err == cudaSuccess && !(a.debug_flags & TRELLIS_SKIP_FC1))
    err = launch(k.fc1, fc1_grid(a, pieces), k.fc1_threads, k.fc1_smem, stream, pdl && !a.direct, a, pieces);
  if (err == cudaSuccess && !(a.debug_flags & TRELLIS_SKIP_ACT)) {
    const int act_blocks = a.intermediate / 128, act_warps = act_blocks < kActWarps ? act_blocks : kActWarps;
    const dim3 act_grid(tiles, activation_row_steps(a), (act_blocks + act_warps - 1) / act_warps);
    err = launch(activation_for(a), act_grid, act_warps * 32, 0, stream, pdl, a, pieces);
  }
  if (err == cudaSuccess && !(a.debug_flags & TRELLIS_SKIP_FC2)) {
    const int blocks = static_cast<int>(k.fc2_grid.x * k.fc2_grid.y);
    const int fc2_smem = even_wave_smem(k.fc2, blocks, k.fc2_threads, k.fc2_smem);
    if ((err = allow_smem(k.fc2, fc2_smem)) == cudaSuccess)
      err = launch(k.fc2, k.fc2_grid, k.fc2_threads, fc2_smem, stream, pdl, a);
  }
  return err;
}

template <int CB, bool FAST>
cudaError_t launch_for_tile(const TrellisMoeArgs& a, cudaStream_t stream, bool pdl) {
  switch (a.m_tile) {
    case 16: return launch_gemms(a, mma_sync_kernels<CB, 1, FAST>(a), stream, pdl);
    case 32: return launch_gemms(a, mma_sync_kernels<CB, 2, FAST>(a), stream, pdl);
    default:
#ifdef TRELLIS_WGMMA
      if (trellis::gemms_on_wgmma(a)) return launch_gemms(a, wgmma_kernels<CB, FAST>(a), stream, pdl);
#endif
      return launch_gemms(a, mma_sync_kernels<CB, 8, FAST>(a), stream, pdl);
  }
}

template <int CB>
cudaError_t launch_for_codebook(const TrellisMoeArgs& a, cudaStream_t stream, bool pdl) {
  return trellis::only_k3_k4(a) ? launch_for_tile<CB, true>(a, stream, pdl)
                                : launch_for_tile<CB, false>(a, stream, pdl);
}

}  // namespace

extern "C" int trellis_abi_version(void) { return TRELLIS_ABI_VERSION; }

extern "C" int trellis_has_wgmma(void) {
#ifdef TRELLIS_WGMMA
  return 1;
#else
  return 0;
#endif
}

#ifdef TRELLIS_TIMELINE
// Copies the timeline of the calls since the last read ([phase][cta][start, waited, end, sm, marks], ns) into
// `host` (kTlPhases * kTlMaxCtas * kTlFields values) and clears it.
extern "C" int trellis_timeline_read(unsigned long long* host) {
  using namespace trellis;
  if (cudaMemcpyFromSymbol(host, g_timeline, sizeof(g_timeline)) != cudaSuccess) return -1;
  static unsigned long long zeros[kTlPhases][kTlMaxCtas][kTlFields];
  return cudaMemcpyToSymbol(g_timeline, zeros, sizeof(g_timeline)) == cudaSuccess ? 0 : -1;
}
#endif

extern "C" int trellis_args_size(void) { return static_cast<int>(sizeof(TrellisMoeArgs)); }

extern "C" const char* trellis_last_error(void) { return g_error; }

extern "C" int trellis_moe_forward(const TrellisMoeArgs* args, void* stream_handle) {
  using namespace trellis;
  if (args == nullptr) return fail("null args");
  const TrellisMoeArgs a = *args;
  if (int rc = check_args(a)) return rc;
  if (a.m == 0) return 0;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  cudaGetLastError();  // a stale error from unrelated work must not be blamed on this call
  const bool pdl = device_has_pdl() && !(a.debug_flags & TRELLIS_NO_PDL);
  cudaError_t err = cudaSuccess;
  if (!a.direct) {
    // The call's first kernel, launched without PDL: it starts once the previous call has finished.
    const int numel = a.m * a.top_k, per_expert = a.num_combined * static_cast<int>(sizeof(int));
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
  if (err == cudaSuccess) {
#ifdef TRELLIS_ONLY_MCG  // experiments: one codebook compiles 3x faster
    if (a.codebook != TRELLIS_CB_MCG) return fail("this build serves the mcg codebook only");
    err = launch_for_codebook<1>(a, stream, pdl);
#else
    switch (a.codebook) {
      case TRELLIS_CB_3INST: err = launch_for_codebook<0>(a, stream, pdl); break;
      case TRELLIS_CB_MCG: err = launch_for_codebook<1>(a, stream, pdl); break;
      default: err = launch_for_codebook<2>(a, stream, pdl); break;
    }
#endif
  }
  if (err == cudaSuccess && !(a.debug_flags & TRELLIS_SKIP_SUM)) {
    dim3 grid(a.m, (a.hidden + 4 * kSumThreads - 1) / (4 * kSumThreads));
    err = launch(topk_sum_for(a), grid, kSumThreads, 0, stream, pdl, a);
  }
  // A skipped phase (timing variants) leaves the hand-over counters short of their reset: clear them.
  if (err == cudaSuccess && trellis::tile_handover(a) &&
      (a.debug_flags & (TRELLIS_SKIP_FC1 | TRELLIS_SKIP_ACT | TRELLIS_SKIP_FC2)))
    err = cudaMemsetAsync(a.handover, 0, 3 * sizeof(int) * a.tile_capacity, stream);
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof(g_error), "CUDA launch failed: %s", cudaGetErrorString(err));
    return static_cast<int>(err);
  }
  return 0;
}
