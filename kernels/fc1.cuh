// FC1 (gate and up) over work tiles on mma.sync (expert_gemm.cuh), with direct mode's resident input row.
#pragma once
#include "chunk_mma.cuh"
#include "copy_pipeline.cuh"
#include "fc1_split.cuh"
#include "handover.cuh"

namespace trellis {

// Direct mode keeps FC1's one input row resident in the (then unused) A ring: per projection and chunk
// 256 expanded halves, plus one zero row that the other 15 lanes of each ldmatrix read. Where the ring of
// half chunks is smaller (fc1_chunk_tiles), the 16-row kernels' shared memory grows to hold them
// (fc1_smem_bytes).
constexpr int kDirectMaxChunks = 48;
constexpr int kDirectRowHalves = (2 * kDirectMaxChunks + 1) * 256;

// Direct mode: fp16(H128(x[token] ⊙ suh_p)) of the CTA's `chunks` chunks from kc0, expanded, into
// resident[p][chunk][256], and zeros into resident[2 * chunks][256]. One half warp per (projection, chunk).
__device__ __forceinline__ void rotate_direct_row(const TrellisMoeArgs& a, const WorkTile& w, int kc0, int chunks,
                                                  __half* resident) {
  const int lane = threadIdx.x & 15, half = (threadIdx.x >> 4) & 1, warp = warp_index();
  const int token = w.start / a.top_k;
  for (int item0 = 2 * warp; item0 < 2 * chunks; item0 += blockDim.x >> 4) {  // whole warps step together
    const int item = item0 + half < 2 * chunks ? item0 + half : item0;  // a spare half warp redoes item0
    const int p = item / chunks, c = item - p * chunks;
    const int col = (kc0 + c) * 128 + 8 * lane;
    float x[8], s[8], v[8];
    load_x8(a, a.x_dtype == TRELLIS_DT_BF16, token, col, x);
    input_suh8(a, w.expert, p, col, s);
    rotate8(x, s, lane, v);
    if (item == item0 + half) store_a_row8(resident + item * 256, 8 * lane, 2, v);
  }
  for (int i = threadIdx.x; i < 256 / 8; i += blockDim.x)
    *reinterpret_cast<uint4*>(resident + 2 * chunks * 256 + 8 * i) = make_uint4(0u, 0u, 0u, 0u);
}

// ---------------------------------------------------------------------------------------------------
// FC1: one CTA per piece (fc1_split.cuh), 16 warps: warp = projection (gate 0-7, up 8-15) x n tile. An
// item is one tile's n block `nchunk` (128 features of gate and of up); fc1_body computes chunks kc0 ..
// kc0 + chunks - 1 of it into partial-sum plane `plane`.

template <int CB, int R, int K, bool FAST>
__device__ void fc1_body(const TrellisMoeArgs& a, const WorkTile& w, int nchunk, int kc0, int chunks, int plane,
                         unsigned char* smem) {
  constexpr int kStages = fc1_stages(R, FAST);
  // The ring stages KT k tiles at a time: kSub staged chunks per 128-column chunk of the piece.
  constexpr int KT = fc1_chunk_tiles(R, FAST), kSub = 8 / KT;
  constexpr int kWeightWords = fc1_stage_weight_words(R, FAST), kAHalves = fc1_stage_a_halves(R, FAST);
  uint32_t* s_w = reinterpret_cast<uint32_t*>(smem);
  __half* s_a = reinterpret_cast<__half*>(smem + kStages * kWeightWords * 4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int proj = warp >> 3, ntl = warp & 7;
  const int n_tiles = a.intermediate >> 4;
  const size_t kt_stride = size_t(n_tiles) * 8 * K;
  const LaneWindow win = lane_window<K>(lane);
  const int live = live_blocks<R>(w.rows);
  const uint32_t* gate_w = projection_words<K>(a, w, 0) + size_t(nchunk) * 8 * 8 * K;
  const uint32_t* up_w = projection_words<K>(a, w, 1) + size_t(nchunk) * 8 * 8 * K;
  constexpr int kX = a_expand(R);
  const bool by_route = small_tile(R) && route_rows(a.m_tile, a.direct);
  const __half* xrot = static_cast<const __half*>(a.xrot) + (by_route ? 0 : size_t(w.start) * 2 * kX * a.hidden);

  const bool direct = small_tile(R) && a.direct;
  if (!direct)
    for (int st = 0; st < kStages; ++st) zero_dead_rows<R, KT>(s_a + st * kAHalves, 2, w.rows);
  // Small tiles use the streams; large tiles the register-lean issue (the objects a kernel does not use
  // are compiled away).
  WeightStream<K, 2, kFc1Threads, small_tile(R), KT> weight_stream(gate_w + size_t(kc0) * 8 * kt_stride, kt_stride,
                                                    size_t(up_w - gate_w), uint32_t(KT * kt_stride));
  RowStream<R, 2, kFc1Threads, small_tile(R), KT> row_stream(xrot + kc0 * 128 * kX, size_t(kX) * a.hidden,
                                                             size_t(2) * kX * a.hidden, direct ? 0 : w.rows);
  const WeightIssue<K, 2, kFc1Threads, KT> weights(kt_stride, size_t(up_w - gate_w));
  const uint32_t w_ring = shared_address(s_w), a_ring = shared_address(s_a);
  auto issue_w = [&](int c, int stage) {
    if (small_tile(R)) weight_stream.issue_next(w_ring + stage * kWeightWords * 4);
    else weights.issue(s_w + stage * kWeightWords, gate_w + size_t(kc0 * kSub + c) * KT * kt_stride);
  };
  auto issue_a = [&](int c, int stage) {  // c: the staged chunk, of 16 * KT columns
    const int kc = kc0 * kSub + c;
    if (small_tile(R)) row_stream.issue_next(a_ring + stage * kAHalves * 2);
    else issue_a_rows<R, 2, kFc1Threads, !FAST, KT>(s_a + stage * kAHalves, xrot + kc * (16 * KT) * kX,
                                                   xrot + kX * a.hidden + kc * (16 * KT) * kX,
                                                   size_t(2) * kX * a.hidden, w.rows);
  };
  float acc[R][2][4];
  zero_acc<R>(acc);
  // Direct mode: lanes 0, 8, 16 and 24 (route 0 of each ldmatrix matrix) read the resident row of this
  // projection, the others the zero row.
  const uint32_t direct_row = a_ring + 2 * ((lane & 7) ? 2 * chunks * 256 : proj * chunks * 256) + 16 * (lane >> 3);
  const uint32_t ring_lane = a_lane_address<R, KT>(a_ring + 2 * proj * R * 16 * a_stride(R, KT), lane);
  staged_chunks<kStages, small_tile(R)>(
      chunks * kSub, issue_w, issue_a,
      [&] {
        after_predecessor();
        if (by_route)
          row_stream.rows_by_route(a, w.start, size_t(2) * kX * a.hidden);
        if (direct) rotate_direct_row(a, w, kc0, chunks, s_a);  // made visible by the loop's first barrier
      },
      [&](int c, int st) {
        const uint32_t a_addr =
            direct ? direct_row + ((lane & 7) ? 0 : 64 * KT * c)  // 32 * KT expanded halves per staged chunk
            : small_tile(R)
                ? ring_lane + 2 * st * kAHalves  // constant st: an immediate
                : a_lane_address<R, KT>(a_ring + 2 * (st * kAHalves + proj * R * 16 * a_stride(R, KT)), lane);
        chunk_mma<K, CB, R, KT>(s_w + st * kWeightWords + proj * KT * 64 * K, ntl, win, a_addr, live, acc);
      });

  const int nt = nchunk * 8 + ntl;
  float* part = static_cast<float*>(a.partial) + size_t(plane) * a.slot_capacity * 2 * a.intermediate;
  const int g = lane >> 2, q = lane & 3;
  if constexpr (small_tile(R)) {
    // feature nt * 16 + f, summed in this order: f's constant 8 (e / 2) folds into the store's immediate offset
    for_each_small_acc<R>(acc, lane, w.rows, [&](int row, int f, float v) {
      part[size_t(w.start + row) * 2 * a.intermediate + proj * a.intermediate + nt * 16 + f] = v;
    });
  } else {  // acc[r][n][e]: route 16r + g + 8 (e / 2), features 8n + 2q + e % 2
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = r * 16 + g + 8 * h;
        if (row >= w.rows) continue;
        float* dst = part + size_t(w.start + row) * 2 * a.intermediate + proj * a.intermediate + nt * 16 + 2 * q;
#pragma unroll
        for (int n = 0; n < 2; ++n)
          *reinterpret_cast<float2*>(dst + n * 8) = make_float2(acc[r][n][2 * h], acc[r][n][2 * h + 1]);
      }
    }
  }
}

template <int CB, int R, bool FAST>
__global__ void __launch_bounds__(kFc1Threads, (small_tile(R) && FAST) ? 2 : 1)
    fc1_kernel(const TrellisMoeArgs a, const Fc1Pieces pieces) {
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  const int nchunks = a.intermediate >> 7;
  Fc1Piece piece;
  WorkTile w;
  if (!fc1_piece(a, pieces, piece) || !load_work_tile(a, piece.item / nchunks, w)) return;
  with_k<FAST>(w.k, [&](auto k) {
    fc1_body<CB, R, decltype(k)::value, FAST>(a, w, piece.item % nchunks, piece.kc0, piece.chunks, piece.plane,
                                              gemm_smem);
  });
  if (small_tile(R) && tile_handover(a)) {  // the piece's partial sums are stored: count it for its tile
    __syncthreads();
    if (threadIdx.x == 0) count_done(handover(a).fc1_done + piece.item / nchunks);
  }
}

// The ring; for 16-row tiles at least direct mode's resident rows in place of its A part.
__host__ __device__ constexpr int fc1_smem_bytes(int r, bool fast) {
  return fc1_stages(r, fast) * fc1_stage_weight_words(r, fast) * 4 +
         2 * (r == 1 && kDirectRowHalves > fc1_stages(r, fast) * fc1_stage_a_halves(r, fast)
                  ? kDirectRowHalves
                  : fc1_stages(r, fast) * fc1_stage_a_halves(r, fast));
}

}  // namespace trellis
