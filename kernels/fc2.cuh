// FC2 (down, with the output rotation and the router weight) over work tiles on mma.sync (expert_gemm.cuh).
#pragma once
#include "chunk_mma.cuh"
#include "copy_pipeline.cuh"
#include "handover.cuh"

namespace trellis {

// The svh row of FC2's output for the tile's expert.
__device__ __forceinline__ const __half* down_svh(const TrellisMoeArgs& a, const WorkTile& w) {
  return static_cast<const __half*>(a.down_svh) + size_t(a.down_svh_shared ? 0 : w.expert) * a.hidden;
}

// FC2's epilogue from staged fp32 output rows s_o [rows][kOStride] (128 columns of H from nchunk * 128,
// the tile's rows row0..row0+rows-1): H128, svh and the router weight, one route row per warp step, into
// route_out. Optional `cached` (shared memory): the tile's routes, router weights and svh, read ahead.
// Where every expert shares one svh row (shared-H packs), the output rotation is the same linear map for
// all routes, so it commutes with the top-k sum: the rows leave unrotated, scaled by the router weight
// alone, and the sum rotates once per token (activation.cuh topk_sum_kernel), a top_k-th of the work.
struct DownRowCache {
  const int* route;     // [tile rows]
  const float* weight;  // [tile rows]
  const __half* svh;    // the columns from nchunk * 128
};
__device__ __forceinline__ void store_down_rows(const TrellisMoeArgs& a, const WorkTile& w, int nchunk,
                                                const float* s_o, int row0, int rows,
                                                const DownRowCache* cached = nullptr) {
  const int lane = threadIdx.x & 31, warp = warp_index();
  const bool rotate = !a.down_svh_shared;
  float s[4] = {1.f, 1.f, 1.f, 1.f};  // times 1 is exact: unrotated rows are the MMA's sums times the weight
  if (rotate) load4_half(cached ? cached->svh + 4 * lane : down_svh(a, w) + nchunk * 128 + 4 * lane, s);
  const int col = nchunk * 128 + 4 * lane;
  for (int row = warp; row < rows; row += blockDim.x >> 5) {
    const int route = cached ? cached->route[row0 + row] : slot_route_of(a, w.start + row0 + row);
    const float weight = cached ? cached->weight[row0 + row] : static_cast<const float*>(a.topk_weights)[route];
    float v[4];
    const float4 o = *reinterpret_cast<const float4*>(s_o + row * kOStride + 4 * lane);
    v[0] = o.x;
    v[1] = o.y;
    v[2] = o.z;
    v[3] = o.w;
    if (rotate) hadamard128(v, lane);
    float4 y = make_float4(v[0] * s[0] * weight, v[1] * s[1] * weight, v[2] * s[2] * weight, v[3] * s[3] * weight);
    *reinterpret_cast<float4*>(static_cast<float*>(a.route_out) + size_t(route) * a.hidden + col) = y;
  }
}

// ---------------------------------------------------------------------------------------------------
// FC2: 8 warps = the 8 n tiles of one 128-column output block, full K = I.
// The epilogue holds whole 128-column blocks, so it applies H128, svh and the router weight itself.
// Small tiles: a CTA computes `span` consecutive blocks of its tile (gemm_unit.cu fc2_span), the copy
// ring running on from one block into the next. A block is only I/128 chunks (4 at I = 512), and a CTA
// of one block spent as long on its tile lookups, first copies and epilogue as on its chunks
// (M = 8-256: of a CTA's 10.9 us, 4.5 before its wait returned and 1.25 of epilogue); a span pays the first two once and hides the epilogues behind copies.

static_assert(kOStride * 4 == a_stride(1) * 2 && kOStride * 4 == a_stride(2) * 2,
              "a small tile's epilogue rows must fit the A rows of one stage");

template <int CB, int R, int K, bool FAST>
__device__ void fc2_body(const TrellisMoeArgs& a, const WorkTile& w, int first_block, int span, unsigned char* smem) {
  constexpr int kFc2Stages = fc2_stages(R, FAST);
  // Staged chunks of KT k tiles, kSub per 128 columns (only 128-row tiles stage fewer: fc2_chunk_tiles).
  constexpr int KT = fc2_chunk_tiles(R, FAST), kSub = 8 / KT;
  static_assert(KT == 8 || !small_tile(R), "small tiles' spans walk whole 128-column chunks");
  constexpr int kWeightWords = fc2_stage_weight_words(R, FAST), kAHalves = fc2_stage_a_halves(R, FAST);
  uint32_t* s_w = reinterpret_cast<uint32_t*>(smem);
  __half* s_a = reinterpret_cast<__half*>(smem + kFc2Stages * kWeightWords * 4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_tiles = a.hidden >> 4;
  const size_t kt_stride = size_t(n_tiles) * 8 * K;
  LaneWindow win = lane_window<K>(lane);
  opaque(win.w0), opaque(win.w1), opaque(win.off);
  const int live = live_blocks<R>(w.rows);
  const int block_chunks = (a.intermediate >> 7) * kSub;
  const uint32_t* wsrc = projection_words<K>(a, w, 2) + size_t(first_block) * 8 * 8 * K;
  constexpr int kX = a_expand(R);
  const __half* act = static_cast<const __half*>(a.act) + size_t(w.start) * kX * a.intermediate;

  for (int st = 0; st < kFc2Stages; ++st) zero_dead_rows<R, KT>(s_a + st * kAHalves, 1, w.rows);
  // Small tiles (as in FC1); after a block's last chunk the weights go on 128 columns, from k = 0.
  WeightStream<K, 1, kFc2Threads, small_tile(R)> weight_stream(
      wsrc, kt_stride, 0, uint32_t(8 * kt_stride), int32_t(8 * 8 * K) - int32_t((block_chunks - 1) * 8 * kt_stride));
  RowStream<R, 1, kFc2Threads, small_tile(R)> row_stream(act, 0, size_t(kX) * a.intermediate, w.rows, block_chunks);
  const WeightIssue<K, 1, kFc2Threads, KT> weights(kt_stride, 0);
  const uint32_t w_ring = shared_address(s_w), a_ring = shared_address(s_a);
  // Spans exist only where I/128 is a power of two (fc2_span), so the test needs no division; otherwise the
  // mask is all ones and no chunk ends a block early.
  const int block_mask = (block_chunks & (block_chunks - 1)) ? -1 : block_chunks - 1;
  auto block_ends = [&](int c) { return ((c + 1) & block_mask) == 0; };
  auto issue_w = [&](int c, int stage) {
    if (small_tile(R)) weight_stream.issue_next(w_ring + stage * kWeightWords * 4, block_ends(c));
    else weights.issue(s_w + stage * kWeightWords, wsrc + size_t(c) * KT * kt_stride);
  };
  auto issue_a = [&](int c, int stage) {
    if (small_tile(R)) {
      row_stream.issue_next(a_ring + stage * kAHalves * 2, block_ends(c));
    } else {
      issue_a_rows<R, 1, kFc2Threads, !FAST, KT>(s_a + stage * kAHalves, act + c * (16 * KT) * kX, nullptr,
                                                 size_t(kX) * a.intermediate, w.rows);
    }
  };
  float acc[R][2][4];
  zero_acc<R>(acc);
  uint32_t ring_lane = a_lane_address<R>(a_ring, lane);
  opaque(ring_lane);
  auto compute = [&](int c, int st) {
    const uint32_t a_addr =
        small_tile(R) ? ring_lane + 2 * st * kAHalves : a_lane_address<R, KT>(a_ring + 2 * st * kAHalves, lane);
    chunk_mma<K, CB, R, KT>(s_w + st * kWeightWords, warp, win, a_addr, live, acc);
  };
  // Small tiles: each block's epilogue, staged in the A rows of the stage its last chunk used (the ring is
  // still loading the next block into the other stages); the CTA's last block, with no copy in flight, at
  // the start of shared memory, which measured faster than staging it in its last stage's A rows.
  auto finish = [&](int b, int st) {
    if constexpr (small_tile(R)) {
      float* s_o = reinterpret_cast<float*>(b + 1 == span ? smem : reinterpret_cast<unsigned char*>(s_a + st * kAHalves));
      __syncthreads();  // every warp is past its MMAs on stage st
      for_each_small_acc<R>(acc, lane, w.rows,
                            [&](int route, int f, float v) { s_o[route * kOStride + warp * 16 + f] = v; });
      __syncthreads();
      store_down_rows(a, w, first_block + b, s_o, 0, w.rows);
      zero_acc<R>(acc);
    }
  };
  // Wait for this tile's activation only (handover.cuh).
  auto wait = [&] {
    if (!(small_tile(R) && tile_handover(a))) {
      after_predecessor();
      return;
    }
    allow_dependents();
    if (threadIdx.x == 0) fc2_takes_tile(a, blockIdx.x, gridDim.y);  // grid (tiles, the tile's CTAs)
    __syncthreads();
  };
  staged_blocks<kFc2Stages, small_tile(R)>(span, block_chunks, issue_w, issue_a, wait, compute, finish);
  if constexpr (!small_tile(R)) {  // one block: the epilogue takes the whole ring
    __syncthreads();
    float* s_o = reinterpret_cast<float*>(smem);
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= live) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int n = 0; n < 2; ++n)
          *reinterpret_cast<float2*>(s_o + (r * 16 + g + 8 * h) * kOStride + warp * 16 + n * 8 + 2 * q) =
              make_float2(acc[r][n][2 * h], acc[r][n][2 * h + 1]);
    }
    __syncthreads();
    store_down_rows(a, w, first_block, s_o, 0, w.rows);
  }
}

// Grid (tiles, groups): blockIdx.x is the tile, blockIdx.y its group of `span` = (H/128) / gridDim.y output
// blocks (always 1 for large tiles: the host sizes the grid).
template <int CB, int R, bool FAST>
__global__ void __launch_bounds__(kFc2Threads, FAST ? (small_tile(R) ? 4 : 2) : 1) fc2_kernel(const TrellisMoeArgs a) {
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  WorkTile w;
  if (!load_work_tile(a, blockIdx.x, w)) return;
  const int span = (a.hidden >> 7) / gridDim.y;
  with_k<FAST>(w.k, [&](auto k) { fc2_body<CB, R, decltype(k)::value, FAST>(a, w, blockIdx.y * span, span, gemm_smem); });
}

__host__ __device__ constexpr int fc2_smem_bytes(int r, bool fast) {
  return (fc2_stages(r, fast) * (fc2_stage_weight_words(r, fast) * 4 + fc2_stage_a_halves(r, fast) * 2) >
          r * 16 * kOStride * 4)
             ? fc2_stages(r, fast) * (fc2_stage_weight_words(r, fast) * 4 + fc2_stage_a_halves(r, fast) * 2)
             : r * 16 * kOStride * 4;
}

}  // namespace trellis
