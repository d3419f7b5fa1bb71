// FC1 and FC2 over large work tiles (up to 128 routes of one expert) on Hopper, with wgmma.
//
// The GEMM runs transposed, y^T = W^T x^T: a lane's B fragments of one decoded 16x16 weight tile
// (decode.cuh) are, reordered, its A fragment of W^T, so the decoded weights feed wgmma straight from
// registers, and the tile's routes are wgmma's N (up to 128), read by the tensor cores from shared
// memory. The MMA is asynchronous: a warp decodes its next weight tile while the last one multiplies.
// (Measured on H200, the decode and the MMAs overlap poorly: together they take 85-90 % of the sum of
// their times alone, since both lean on the register file, which the tensor cores use for the fp32
// accumulators.)
//
// A CTA is 4 warpgroups = 16 warps = 256 features (warp w: features 16w..16w+15) of one projection, over
// the tile's 128 routes. The route rows are the heavy operand (128 x 2 bytes per k against 256 x ~0.4
// bytes of codes), so the wider the feature block, the less L2 traffic per decoded weight: with 128
// features, FC1 read 5.6 GB of rows from L2 at M=3072 and ran at 80 % of L2 throughput.
// The k loop walks 128-wide chunks through a cp.async ring of weights and route rows, as in
// expert_gemm.cuh; the result goes through shared memory to the same epilogues.
#pragma once
#include "expert_gemm.cuh"
#include "wgmma.cuh"

namespace trellis {

constexpr int kWgThreads = 512;
constexpr int kWgRows = 128;      // routes per work tile: the largest wgmma N
constexpr int kWgFeatures = 256;  // features per CTA: 4 warpgroups x 64
static_assert(kWgFeatures == kFc1WgmmaFeatures, "FC1's items (fc1_split.cuh) are one CTA's features");
// 3 stages of the ring for the wide K3/K4 kernels (two chunks load while one multiplies); the all-K kernel
// keeps 2, its weights take twice the room, and so do the narrow kernels, so that two CTAs' rings fit in
// one SM's shared memory.
__host__ __device__ constexpr int wg_stages(bool fast, int rows) { return fast && rows == 128 ? 3 : 2; }
// FC2 walks only I/128 chunks per 256 features (4 at I = 512), so each CTA takes this many feature blocks
// of one tile in a row: the ring runs on across them, and a block's epilogue overlaps the next one's loads.
constexpr int kFc2BlocksPerCta = 4;
// Route rows of one chunk as wgmma's B, in the 128-byte swizzled K-major layout: two k halves of 64
// columns, each [128 rows][128 bytes] with 16-byte piece c of row r at position c ^ (r % 8). A warp's copy
// of 4 whole rows is then 4 full 128-byte lines in global memory and 512 contiguous bytes in shared memory
// (the unswizzled 8x8 core-matrix layout spread each warp's copy over 8 rows and cost 2x the wavefronts).
// Narrow kernels stage 64 of a tile's rows per pass instead of 128 (wg_gemm's ROWS): half the accumulators
// and, with 2 stages, 100 KB of shared memory, so two CTAs share an SM (K3/K4 tiles, few routes per expert).
constexpr int kWgNarrowRows = 64;
__host__ __device__ constexpr int wg_half_bytes(int rows) { return rows * 128; }  // one k half of the rows
constexpr int kWgSwizzleAtomBytes = 8 * 128;  // 8 rows of 128 bytes: the stride between 8-row groups
__host__ __device__ constexpr int wg_weight_bytes(bool fast) { return 2 * 8 * 64 * max_k(fast) * 4; }
__host__ __device__ constexpr int wg_stage_bytes(bool fast, int rows) {
  return wg_weight_bytes(fast) + 2 * wg_half_bytes(rows);
}
// The result leaves through shared memory in passes of 32 routes: [half (2)][32 routes][kOStride] fp32,
// behind the ring.
constexpr int kWgPassRows = 32;
constexpr int kWgStagingBytes = 2 * kWgPassRows * kOStride * 4;
// FC2 reads its tile's routes, router weights and svh columns into shared memory once, ahead of the
// epilogues (loaded there, their latency stalled every pass): [128] int, [128] float, [blocks * 256] fp16.
constexpr int kWgCacheBytes = kWgRows * 8 + kFc2BlocksPerCta * kWgFeatures * 2;
__host__ __device__ constexpr int wg_smem_bytes(bool fast, int rows) {
  return wg_stages(fast, rows) * wg_stage_bytes(fast, rows) + kWgStagingBytes + kWgCacheBytes;
}

// Rows gathered by token (rows_by_token, FC1 of shared-H packs): row r of the tile is row
// slot_token(*args, slot + r) of `base`, `stride` halves per token. base == nullptr: rows in place.
struct WgRowGather {
  const __half* base = nullptr;
  size_t stride = 0;
  const TrellisMoeArgs* args = nullptr;
  int slot = 0;
};

// A chunk's route rows [rows][128] fp16 (rows `row_stride` halves apart) into the swizzled layout of ROWS
// rows. Piece i = threadIdx.x + 512 j is 16-byte piece i % 8 of row (i / 8) % ROWS in k half (i / 8) / ROWS,
// so a thread keeps its piece: of 128 rows it copies rows r0 and r0 + 64 of both halves, of 64 row r0 of
// both. Rows past `rows` are never written (zeroed once, below). Chunks are 128 columns apart.
template <int ROWS>
struct WgRowStream {
  static constexpr int kItems = ROWS * 16 / kWgThreads;  // pieces per thread: 4 of 128 rows, 2 of 64
  static_assert(ROWS == 128 || ROWS == 64, "128 or 64 rows");
  const __half* src[2];  // rows r0 and r0 + 64 (of 128), at this thread's piece
  uint32_t dst[2];  // bytes from the stage's rows: rows r0 and r0 + 64 of k half 0
  bool live[2];

  __device__ __forceinline__ WgRowStream(const __half* first, size_t row_stride, int rows) {
    const int piece = threadIdx.x & 7, r0 = threadIdx.x >> 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 64 * h;
      src[h] = first + r * row_stride + piece * 8;
      dst[h] = uint32_t(r * 128 + ((piece ^ (r & 7)) * 16));
      live[h] = r < rows;
    }
  }
  // Called once the route pack has finished (the slot list is its output).
  __device__ __forceinline__ void gather(const WgRowGather& g) {
    const int piece = threadIdx.x & 7, r0 = threadIdx.x >> 3;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (live[h]) src[h] = g.base + slot_token(*g.args, g.slot + r0 + 64 * h) * g.stride + piece * 8;
  }
  // Item j: row r0 + 64 (j % 2) of k half j / 2 (128 rows), row r0 of k half j (64 rows).
  __device__ __forceinline__ void issue(uint32_t stage, int chunk) const {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int h = ROWS == 128 ? j & 1 : 0, half = ROWS == 128 ? j >> 1 : j;
      if (live[h]) cp_async16(stage + half * wg_half_bytes(ROWS) + dst[h], src[h] + chunk * 128 + half * 64);
    }
  }
  __device__ __forceinline__ void zero_dead(unsigned char* stage) const {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int h = ROWS == 128 ? j & 1 : 0, half = ROWS == 128 ? j >> 1 : j;
      if (!live[h])
        *reinterpret_cast<uint4*>(stage + half * wg_half_bytes(ROWS) + dst[h]) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
};

#ifdef TRELLIS_DEVICE_WGMMA
// acc[N routes x this warp's 16 features] += the 8 k tiles of a staged chunk. Each 16x16 weight tile is
// decoded into registers and handed to one wgmma; up to two MMAs stay in flight while the next tile's
// words load and decode, so the tensor cores always have queued work. The chunk ends with every MMA done:
// MMAs left in flight across the chunk loop's back edge make ptxas serialize all of them (C7515).
template <int K, int CB, int N, int ROWS>
__device__ __forceinline__ void chunk_wgmma(const uint32_t* run, int ntl, const LaneWindow& win, uint32_t rows_addr,
                                            float (&acc)[64]) {
  const uint32_t* w0 = run + ntl * 8 * K + win.w0;
  const uint32_t* w1 = run + ntl * 8 * K + win.w1;
  const uint32_t* w2 = run + ntl * 8 * K + win.w2;
  auto load = [&](int kt) {
    TileWords t;
    t.u0 = w0[kt * 64 * K];
    t.u1 = w1[kt * 64 * K];
    t.u2 = K >= 5 ? w2[kt * 64 * K] : 0u;
    return t;
  };
  TileWords next = load(0);
  const uint64_t rows_desc = swizzled_descriptor(rows_addr, kWgSwizzleAtomBytes);
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    const TileWords t = next;
    if (kt < 7) next = load(kt + 1);  // ahead of the MMA wait below, which the compiler may not cross
    uint32_t b[4];
    decode_fragments<K, CB>(t, win, b);
    // B fragments of W (k x features) -> A fragment of W^T (features x k): rows g | g+8, k 2t | 2t+8.
    const uint32_t a_frag[4] = {b[0], b[2], b[1], b[3]};
    wgmma_wait<1>();  // the MMA two tiles back is done: its A registers may be reused
    wgmma_fence();
    // k half kt / 4, 16 columns in it
    wgmma_m64nNk16<N>(acc, a_frag, descriptor_plus(rows_desc, (kt >> 2) * wg_half_bytes(ROWS) + (kt & 3) * 32));
    wgmma_commit();
  }
  wgmma_wait<0>();  // the stage is free for the next copy once every warp passes the barrier
}
#endif

// y^T[256 features][N routes] for `blocks` consecutive 256-feature blocks, each over `chunks` chunks (the
// tile's `rows` <= N routes; the MMA's time is proportional to N, so callers pick the smallest, with_n).
// prepare() runs once the first weight stages are issued: it waits for what the route rows need (the
// previous kernel, or the tile's hand-over) and may read it; after each block, store(block, row0,
// s_pass) runs per pass of 32 routes from row0, with s_pass [half][32 routes][kOStride] fp32 in shared
// memory. wsrc: block 0's weight words at chunk 0 (its second 128
// features follow 8 n tiles later; block b is b * block_words further); rsrc: the tile's first route row.
template <int CB, int K, bool FAST, int N, int ROWS, typename Prepare, typename Store>
__device__ void wg_gemm(const uint32_t* wsrc, size_t block_words, size_t kt_stride, const __half* rsrc,
                        size_t row_stride, int rows, int chunks, int blocks, unsigned char* smem, Prepare&& prepare,
                        Store&& store, const WgRowGather& gather = WgRowGather{}) {
#ifdef TRELLIS_DEVICE_WGMMA
  constexpr int kStages = wg_stages(FAST, ROWS), kStageBytes = wg_stage_bytes(FAST, ROWS);
  constexpr int kWeightBytes = wg_weight_bytes(FAST);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneWindow win = lane_window<K>(lane);
  const uint32_t ring = shared_address(smem);
  const WeightIssue<K, 2, kWgThreads> weights(kt_stride, 8 * 8 * K);  // "sources": the two 128-feature halves
  WgRowStream<ROWS> row_stream(rsrc, row_stride, rows);
  for (int st = 0; st < kStages; ++st) row_stream.zero_dead(smem + st * kStageBytes + kWeightBytes);
  auto stage_words = [&](int st) { return reinterpret_cast<uint32_t*>(smem + st * kStageBytes); };
  const int total = blocks * chunks;
  // The next chunk to issue: its block's weight words and its index in the block (no division per chunk).
  const uint32_t* issue_block = wsrc;
  int issue_c = 0;
  auto advance_issue = [&]() {
    if (++issue_c == chunks) {
      issue_c = 0;
      issue_block += block_words;
    }
  };
  // Weights do not depend on the previous kernel: their first stages load while it drains.
#pragma unroll
  for (int g = 0; g < kStages - 1; ++g) {
    if (g < total) weights.issue(stage_words(g), issue_block + size_t(issue_c) * 8 * kt_stride);
    advance_issue();
    cp_async_commit();
  }
  prepare();  // made visible by the loop's first barrier
  if (gather.base) row_stream.gather(gather);
#pragma unroll
  for (int g = 0; g < kStages - 1; ++g) {
    if (g < total) row_stream.issue(ring + g * kStageBytes + kWeightBytes, g % chunks);
    cp_async_commit();
  }
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  const uint32_t* run = reinterpret_cast<const uint32_t*>(smem) + (warp >> 3) * 8 * 64 * K;  // this warp's half
  float* s_pass = reinterpret_cast<float*>(smem + kStages * kStageBytes) + (warp >> 3) * kWgPassRows * kOStride;
  const int g_row = lane >> 2, t = lane & 3, col = (warp & 7) * 16 + g_row;
  // Chunk g = block * chunks + c loads into stage g % S, S - 1 chunks ahead, across block boundaries.
  for (int block = 0, g = 0, st = 0, st_issue = kStages - 1; block < blocks; ++block) {
    for (int c = 0; c < chunks; ++c, ++g) {
      cp_async_wait<kStages - 2>();
      wgmma_fence_shared_writes();
      __syncthreads();  // chunk g is in, and every warp is done with chunk g - 1's stage
      if (g + kStages - 1 < total) {
        weights.issue(stage_words(st_issue), issue_block + size_t(issue_c) * 8 * kt_stride);
        row_stream.issue(ring + st_issue * kStageBytes + kWeightBytes, issue_c);
        advance_issue();
      }
      cp_async_commit();
      chunk_wgmma<K, CB, N, ROWS>(run + st * (kStageBytes / 4), warp & 7, win, ring + st * kStageBytes + kWeightBytes,
                                  acc);
      st = st + 1 == kStages ? 0 : st + 1;
      st_issue = st_issue + 1 == kStages ? 0 : st_issue + 1;
    }
    // chunk_wgmma waited for the block's MMAs: d[4i + e] is feature 16 warp + g_row (+8 for e >= 2) and
    // route 8i + 2t (+1 for odd e).
    wgmma_fence_accumulators(acc);
#pragma unroll
    for (int pass = 0; pass < (N + kWgPassRows - 1) / kWgPassRows; ++pass) {
      if (pass * kWgPassRows < rows) {
#pragma unroll
        for (int i = 0; i < kWgPassRows / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s_pass[(8 * i + 2 * t + (e & 1)) * kOStride + col + 8 * (e >> 1)] =
                acc[4 * (pass * kWgPassRows / 8 + i) + e];
        __syncthreads();
        store(block, pass * kWgPassRows, reinterpret_cast<const float*>(smem + kStages * kStageBytes));
        __syncthreads();
      }
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  }
  cp_async_wait<0>();
#endif
}

// Calls body(IntConst<N>{}) with the wgmma N for a tile of `rows` routes: the smallest multiple of 16 that
// holds them (glm52-tp4 at top-8: about 16 routes per tile at M=512, 32 at M=1024, 96 at M=3072; steps of
// 32 took up to 2.5 % longer at M = 448-2048). The all-K kernel keeps
// N = 128 alone, which bounds its code size.
template <bool FAST, int ROWS, typename Body>
__device__ __forceinline__ void with_n(int rows, Body&& body) {
  if constexpr (!FAST) {
    body(IntConst<128>{});
  } else {
    if (rows <= 16) body(IntConst<16>{});
    else if (rows <= 32) body(IntConst<32>{});
    else if (rows <= 48) body(IntConst<48>{});
    else if constexpr (ROWS < kWgRows) body(IntConst<64>{});  // a narrow pass holds at most 64 rows
    else if (rows <= 64) body(IntConst<64>{});
    else if (rows <= 80) body(IntConst<80>{});
    else if (rows <= 96) body(IntConst<96>{});
    else if (rows <= 112) body(IntConst<112>{});
    else body(IntConst<128>{});
  }
}

// Calls pass(row0, rows) for the tile's rows in passes of at most ROWS: once for the 128-row kernels, and in
// the narrow ones once more (decoding the weights again) for each 64 routes past the first, which few
// tiles have where the host picks them.
template <int ROWS, typename Pass>
__device__ __forceinline__ void for_row_passes(int rows, Pass&& pass) {
  if constexpr (ROWS >= kWgRows) {
    pass(0, rows);
  } else {
    for (int row0 = 0; row0 < rows; row0 += ROWS) pass(row0, min(ROWS, rows - row0));
  }
}

// FC1: one CTA per piece (fc1_split.cuh); item b of a tile: projection b / (I/256), features
// (b % (I/256)) * 256.
template <int CB, bool FAST, int ROWS>
__global__ void __launch_bounds__(kWgThreads, ROWS < kWgRows ? 2 : 1)
    fc1_wgmma_kernel(const TrellisMoeArgs a, const Fc1Pieces pieces) {
  extern __shared__ __align__(1024) unsigned char wg_smem[];
  const int blocks = a.intermediate / kWgFeatures;
  Fc1Piece piece;
  WorkTile w;
  if (!fc1_piece(a, pieces, piece) || !load_work_tile(a, piece.item / (2 * blocks), w)) return;
  const int block = piece.item % (2 * blocks), proj = block / blocks, nblock = block % blocks;
  const int chunks = piece.chunks, kc0 = piece.kc0;
  float* part = static_cast<float*>(a.partial) + size_t(piece.plane) * a.slot_capacity * 2 * a.intermediate +
                size_t(w.start) * 2 * a.intermediate + proj * a.intermediate + nblock * kWgFeatures;
  int pass_row0 = 0;  // the narrow kernels' pass (for_row_passes)
  auto store = [&](int, int row0, const float* s_pass) {
    if constexpr (ROWS < kWgRows) row0 += pass_row0;
    const int lane = threadIdx.x & 31, rows = min(kWgPassRows, w.rows - row0);
    for (int item = threadIdx.x >> 5; item < 2 * rows; item += kWgThreads / 32) {  // (row, half)
      const int half = item & 1, row = item >> 1;
      *reinterpret_cast<float4*>(part + size_t(row0 + row) * 2 * a.intermediate + half * 128 + 4 * lane) =
          *reinterpret_cast<const float4*>(s_pass + (half * kWgPassRows + row) * kOStride + 4 * lane);
    }
  };
  with_k<FAST>(w.k, [&](auto k) {
    constexpr int K = decltype(k)::value;
    const size_t kt_stride = size_t(a.intermediate >> 4) * 8 * K;
    const uint32_t* wsrc =
        projection_words<K>(a, w, proj) + size_t(nblock) * 16 * 8 * K + size_t(kc0) * 8 * kt_stride;
    const __half* rows = static_cast<const __half*>(a.xrot) + (size_t(w.start) * 2 + proj) * a.hidden + kc0 * 128;
    WgRowGather by_token;  // shared-H: rows per token (rows_by_token)
    if (rows_by_token(a)) {
      by_token.base = static_cast<const __half*>(a.xrot) + proj * a.hidden + kc0 * 128;
      by_token.stride = size_t(2) * a.hidden;
      by_token.args = &a;
    }
    for_row_passes<ROWS>(w.rows, [&](int row0, int pass_rows) {
      pass_row0 = row0;
      by_token.slot = w.start + row0;
      with_n<FAST, ROWS>(pass_rows, [&](auto n) {
        wg_gemm<CB, K, FAST, decltype(n)::value, ROWS>(wsrc, 0, kt_stride, rows + size_t(row0) * 2 * a.hidden,
                                                       size_t(2) * a.hidden, pass_rows, chunks, 1, wg_smem,
                                                       [] { after_predecessor(); }, store, by_token);
      });
    });
  });
  // The narrow kernels hand over by tile (the host launches them exactly where handover.cuh tile_handover
  // holds): the piece's partial sums are stored, ordered by wg_gemm's last barrier.
  if constexpr (ROWS < kWgRows) {
    if (threadIdx.x == 0) count_done(handover(a).fc1_done + piece.item / (2 * blocks));
  }
}

// FC2: grid (tiles * ceil(H/256 / kFc2BlocksPerCta)): up to kFc2BlocksPerCta blocks of 256 output columns,
// each over the whole intermediate.
__host__ __device__ constexpr int fc2_wgmma_groups(int hidden) {
  return (hidden / kWgFeatures + kFc2BlocksPerCta - 1) / kFc2BlocksPerCta;
}

template <int CB, bool FAST, int ROWS>
__global__ void __launch_bounds__(kWgThreads, ROWS < kWgRows ? 2 : 1) fc2_wgmma_kernel(const TrellisMoeArgs a) {
  extern __shared__ __align__(1024) unsigned char wg_smem[];
  const int groups = fc2_wgmma_groups(a.hidden);
  WorkTile w;
  if (!load_work_tile(a, blockIdx.x / groups, w)) return;
  const int block0 = (blockIdx.x % groups) * kFc2BlocksPerCta;
  const int blocks = min(kFc2BlocksPerCta, a.hidden / kWgFeatures - block0);
  unsigned char* cache = wg_smem + wg_smem_bytes(FAST, ROWS) - kWgCacheBytes;
  int* s_route = reinterpret_cast<int*>(cache);
  float* s_weight = reinterpret_cast<float*>(cache + kWgRows * 4);
  __half* s_svh = reinterpret_cast<__half*>(cache + kWgRows * 8);
  int pass_row0 = 0;  // the narrow kernels' pass (for_row_passes)
  auto prepare = [&] {
    if constexpr (ROWS < kWgRows) {  // hand-over by tile (as in FC1): this tile's activation, once per CTA
      if (pass_row0 == 0) {
        allow_dependents();
        if (threadIdx.x == 0) fc2_takes_tile(a, blockIdx.x / groups, groups);
        __syncthreads();
      }
    } else {
      after_predecessor();
    }
    for (int row = threadIdx.x; row < w.rows; row += kWgThreads) {
      s_route[row] = slot_route_of(a, w.start + row);
      s_weight[row] = static_cast<const float*>(a.topk_weights)[s_route[row]];
    }
    const __half* svh = down_svh(a, w) + block0 * kWgFeatures;
    for (int i = threadIdx.x; i < blocks * kWgFeatures / 8; i += kWgThreads)
      reinterpret_cast<uint4*>(s_svh)[i] = reinterpret_cast<const uint4*>(svh)[i];
  };
  auto store = [&](int block, int row0, const float* s_pass) {
    if constexpr (ROWS < kWgRows) row0 += pass_row0;
    const int rows = min(kWgPassRows, w.rows - row0);
    for (int half = 0; half < 2; ++half) {
      const DownRowCache cached{s_route, s_weight, s_svh + (2 * block + half) * 128};
      store_down_rows(a, w, 2 * (block0 + block) + half, s_pass + half * kWgPassRows * kOStride, row0, rows,
                      &cached);
    }
  };
  with_k<FAST>(w.k, [&](auto k) {
    constexpr int K = decltype(k)::value;
    const size_t kt_stride = size_t(a.hidden >> 4) * 8 * K;
    const uint32_t* wsrc = projection_words<K>(a, w, 2) + size_t(block0) * 16 * 8 * K;
    const __half* rows = static_cast<const __half*>(a.act) + size_t(w.start) * a.intermediate;
    for_row_passes<ROWS>(w.rows, [&](int row0, int pass_rows) {
      pass_row0 = row0;
      with_n<FAST, ROWS>(pass_rows, [&](auto n) {
        wg_gemm<CB, K, FAST, decltype(n)::value, ROWS>(wsrc, size_t(16) * 8 * K, kt_stride,
                                                       rows + size_t(row0) * a.intermediate, size_t(a.intermediate),
                                                       pass_rows, a.intermediate >> 7, blocks, wg_smem, prepare,
                                                       store);
      });
    });
  });
}

}  // namespace trellis
