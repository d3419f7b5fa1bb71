// FC1 (gate and up) and FC2 (down) over work tiles of one expert, weights decoded on the fly.
//
// A work tile is up to R*16 routes of one expert (route_pack.cuh). Each warp owns one 16-column n tile
// of one projection and walks the k dimension in 128-wide chunks: it decodes each 16x16 weight tile once
// into registers and applies it to every live block of routes of the work tile (chunk_mma), so at large
// M a decoded weight is reused R times. The route rows (rotated input for FC1, activated intermediate for
// FC2) are staged per chunk in shared memory as fp16.
//
// FC1 splits the hidden dimension into ranges, each CTA one range of one item (fc1_split.cuh), and writes
// fp32 partial sums per range; the activation phase adds them in a fixed order, so the result never
// depends on scheduling.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "abi.h"
#include "decode.cuh"
#include "handover.cuh"
#include "fc1_split.cuh"
#include "route_pack.cuh"
#include "warp_ops.cuh"

namespace trellis {

// Work tiles of R m16 blocks: R = 1 and 2 (16 and 32 rows, small and mid M) multiply split codebook words
// (decode.cuh) against activations stored with every column twice (expanded_col) and stream their copies;
// R = 8 (128 rows, large M) keeps the merged fp16 weight, plain rows and register-lean copies.
__host__ __device__ constexpr bool small_tile(int r) { return r <= 2; }
__host__ __device__ constexpr int a_expand(int r) { return small_tile(r) ? 2 : 1; }
__host__ __device__ constexpr int expand_of_m_tile(int m_tile) { return m_tile <= 32 ? 2 : 1; }
// 16- and 32-row tiles keep FC1's rotated input rows per route, not per slot (rotate_routes_kernel), so
// the rotation needs no tile list and runs beside the route pack instead of after it.
__host__ __device__ constexpr bool route_rows(int m_tile, bool direct) { return m_tile <= 32 && !direct; }
// Shared-H packs (one gate and one up suh row for every expert): all routes of a token have the same
// rotated input, so the rotation runs once per token and FC1 reads row `route / top_k`, wherever it gathers
// its rows by index anyway: route rows, and the wgmma 128-row tiles (expert_wgmma.cuh). A top_k-th of the
// rotation's work and writes (glm52-tp4 M=3072: 578 MB of rotated rows per call otherwise).
__host__ __device__ __forceinline__ bool rows_by_token(const TrellisMoeArgs& a) {
  return a.gate_suh_shared && a.up_suh_shared && (route_rows(a.m_tile, a.direct) || gemms_on_wgmma(a));
}
// The token of the route in `slot`. route / top_k is a shift for the usual power-of-two top_k
// (an integer division costs ~20 instructions).
__device__ __forceinline__ size_t slot_token(const TrellisMoeArgs& a, int slot) {
  const int route = static_cast<const int*>(a.slot_route)[slot];
  return (a.top_k & (a.top_k - 1)) ? route / a.top_k : route >> (__ffs(a.top_k) - 1);
}
// Halves per staged row: a chunk's 128 (or 256 expanded) + 8 of padding keeps ldmatrix conflict-free.
__host__ __device__ constexpr int a_stride(int r) { return 128 * a_expand(r) + 8; }
constexpr int kOStride = 132;  // floats per epilogue row
constexpr int kFc1Threads = 512;
constexpr int kFc2Threads = 256;

struct WorkTile {
  int expert, start, rows, tier, local, k;
};

// Direct mode reads the layer inputs only, so a kernel may call it before its predecessor finishes.
__device__ __forceinline__ bool load_work_tile(const TrellisMoeArgs& a, int tile, WorkTile& w) {
  if (a.direct) {
    if (tile >= a.m * a.top_k || (w.expert = route_combined(a, tile)) < 0) return false;
    w.start = tile;
    w.rows = 1;
  } else {
    if (tile >= *static_cast<const int*>(a.tile_count)) return false;
    w.expert = static_cast<const int*>(a.tile_expert)[tile];
    w.start = static_cast<const int*>(a.tile_start)[tile];
    w.rows = static_cast<const int*>(a.tile_rows)[tile];
  }
  const int d = static_cast<const int*>(a.descriptors)[w.expert];
  w.tier = d >> 8;
  w.local = d & 0xFF;
  w.k = a.tier_k[w.tier];
  return true;
}

// The route computed in slot `slot`.
__device__ __forceinline__ int slot_route_of(const TrellisMoeArgs& a, int slot) {
  return a.direct ? slot : static_cast<const int*>(a.slot_route)[slot];
}

// Words of projection `proj` of the tile's expert (tier layout [E_t, 3, tiles, 16K] int16).
template <int K>
__device__ __forceinline__ const uint32_t* projection_words(const TrellisMoeArgs& a, const WorkTile& w, int proj) {
  const size_t tiles = size_t(a.hidden >> 4) * size_t(a.intermediate >> 4);
  return static_cast<const uint32_t*>(a.tier_trellis[w.tier]) + (size_t(w.local) * 3 + proj) * tiles * (8 * K);
}

__device__ __forceinline__ void load4_half(const __half* p, float v[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __half2 p0 = *reinterpret_cast<const __half2*>(&raw.x);
  const __half2 p1 = *reinterpret_cast<const __half2*>(&raw.y);
  v[0] = __low2float(p0);
  v[1] = __high2float(p0);
  v[2] = __low2float(p1);
  v[3] = __high2float(p1);
}

// Eight consecutive fp16 or bf16 values (16 bytes) as floats.
__device__ __forceinline__ void load8(bool bf16, const void* p, float v[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (bf16) {
      const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&words[i]);
      v[2 * i] = __low2float(b);
      v[2 * i + 1] = __high2float(b);
    } else {
      const __half2 h = *reinterpret_cast<const __half2*>(&words[i]);
      v[2 * i] = __low2float(h);
      v[2 * i + 1] = __high2float(h);
    }
  }
}

// Eight fp16 values times 1/sqrt(128): the vectors that carry an unscaled H128's scale (suh, svh).
__device__ __forceinline__ void load8_rotation_scaled(const __half* p, float v[8]) {
  load8(false, p, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] *= kHadamardScale;
}

// Eight floats as fp16 (saturated) into the 16 bytes at p.
__device__ __forceinline__ void store8_half(__half* p, const float v[8]) {
  *reinterpret_cast<uint4*>(p) = make_uint4(to_half2_sat(v[0], v[1]), to_half2_sat(v[2], v[3]),
                                            to_half2_sat(v[4], v[5]), to_half2_sat(v[6], v[7]));
}

// Columns col..col+7 (col % 8 == 0) of an A row: plain (expand 1) or with every column twice (expand 2).
__device__ __forceinline__ void store_a_row8(__half* row, int col, int expand, const float v[8]) {
  if (expand == 1) {
    store8_half(row + col, v);
    return;
  }
  const float even[8] = {v[0], v[0], v[2], v[2], v[4], v[4], v[6], v[6]};
  const float odd[8] = {v[1], v[1], v[3], v[3], v[5], v[5], v[7], v[7]};
  store8_half(row + expanded_col(col), even);
  store8_half(row + expanded_col(col + 1), odd);
}

// The suh row of FC1 projection p (0 gate, 1 up) for `expert`, or the layer's one shared row.
__device__ __forceinline__ const __half* input_suh(const TrellisMoeArgs& a, int expert, int p) {
  const bool shared = p ? a.up_suh_shared : a.gate_suh_shared;
  return static_cast<const __half*>(p ? a.up_suh : a.gate_suh) + size_t(shared ? 0 : expert) * a.hidden;
}

// H128(x ⊙ s) of one 128-column block across a half warp: lane l (0..15) holds columns 8l..8l+7 of x and
// of s, with s already scaled by 1/sqrt(128) (input_suh8). Every lane of the warp must call it.
__device__ __forceinline__ void rotate8(const float x[8], const float s[8], int lane, float v[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = x[i] * s[i];
  hadamard128_unscaled<16>(v, lane);
}

// Columns col..col+7 of suh row p for `expert`, times 1/sqrt(128): the rotation's scale rides on it.
__device__ __forceinline__ void input_suh8(const TrellisMoeArgs& a, int expert, int p, int col, float s[8]) {
  load8_rotation_scaled(input_suh(a, expert, p) + col, s);
}

// Columns col..col+7 of token `token`'s input row (bf16 when `bf16`, else fp16) as floats. A kernel that
// converts many rows takes `bf16` as a template argument: a run-time flag makes the compiler issue both
// conversions, one of them predicated off, which still costs issue slots.
__device__ __forceinline__ void load_x8(const TrellisMoeArgs& a, bool bf16, size_t token, int col, float x[8]) {
  load8(bf16, static_cast<const char*>(a.x) + (token * a.hidden + col) * 2, x);
}

// Weights and A rows of a 128-wide k chunk travel global -> shared with 16-byte cp.async through a ring of
// STAGES buffers, so the loads of the next chunks are in flight while the current one is decoded.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {  // dst: shared-space address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async16(shared_address(dst), src); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Runs step(c, c % S, (c + S - 1) % S) for c = 0 .. chunks-1: the chunk, its stage, and the stage of the
// chunk issued during it. UNROLL walks whole rounds of the ring, so every stage offset in step is a
// compile-time constant: the chunk loop spends the same integer budget as the decode, and this saves
// about 3 integer instructions per decoded tile (small and mid tiles; large tiles have no registers for
// several copies of the loop body).
template <int S, bool UNROLL, typename Step>
__device__ __forceinline__ void chunk_loop(int chunks, Step&& step) {
  if constexpr (UNROLL) {
    for (int c0 = 0; c0 < chunks; c0 += S) {
#pragma unroll
      for (int st = 0; st < S; ++st)
        if (c0 + st < chunks) step(c0 + st, st, (st + S - 1) % S);
    }
  } else {
    for (int c = 0, st = 0, st_issue = S - 1; c < chunks; ++c) {
      step(c, st, st_issue);
      st = st + 1 == S ? 0 : st + 1;
      st_issue = st_issue + 1 == S ? 0 : st_issue + 1;
    }
  }
}

// The chunk pipeline of FC1 and FC2: the weights of the first S - 1 chunks are issued before the wait on
// the previous kernel (weights never depend on it), then after_wait() runs and the A rows of those chunks
// are issued; then, per chunk: wait for it, barrier, issue chunk c + S - 1 into the stage chunk c - 1 freed,
// and compute(c, stage). issue_w / issue_a(c, stage) issue chunk c's copies into a stage.
// The chunks may form `blocks` blocks of `block_chunks` (FC2's output blocks): finish(b, stage) runs after
// block b's last chunk, `stage` being the one that chunk used, while the ring already loads the next
// block. Each block must start at stage 0 (one block, or S dividing block_chunks), so the unrolled loop's
// stages stay compile-time constants.
template <int S, bool UNROLL, typename IssueW, typename IssueA, typename AfterWait, typename Compute, typename Finish>
__device__ __forceinline__ void staged_blocks(int blocks, int block_chunks, IssueW&& issue_w, IssueA&& issue_a,
                                              AfterWait&& after_wait, Compute&& compute, Finish&& finish) {
  const int chunks = blocks * block_chunks;
#pragma unroll
  for (int c = 0; c < S - 1; ++c) {
    if (c < chunks) issue_w(c, c);
    cp_async_commit();
  }
  after_wait();  // waits for the previous phase first
#pragma unroll
  for (int c = 0; c < S - 1; ++c) {
    if (c < chunks) issue_a(c, c);
    cp_async_commit();
  }
  for (int b = 0; b < blocks; ++b) {
    const int first = b * block_chunks;
    chunk_loop<S, UNROLL>(block_chunks, [&](int kc, int st, int st_issue) {
      const int c = first + kc;
      cp_async_wait<S - 2>();
      __syncthreads();
      if (c + S - 1 < chunks) {
        issue_w(c + S - 1, st_issue);
        issue_a(c + S - 1, st_issue);
      }
      cp_async_commit();
      compute(c, st);
    });
    finish(b, (block_chunks - 1) % S);
  }
  cp_async_wait<0>();
}

template <int S, bool UNROLL, typename IssueW, typename IssueA, typename AfterWait, typename Compute>
__device__ __forceinline__ void staged_chunks(int chunks, IssueW&& issue_w, IssueA&& issue_a, AfterWait&& after_wait,
                                              Compute&& compute) {
  staged_blocks<S, UNROLL>(1, chunks, issue_w, issue_a, after_wait, compute, [](int, int) {});
}

// Each thread copies the same few 16-byte pieces of every chunk, from addresses that advance by a fixed
// step from one chunk to the next. The streams below work out a thread's pieces once and keep one global
// pointer and one shared offset per piece, so issuing a chunk costs a 64-bit add and a copy per piece,
// not a division chain. Chunks must be issued in order, each once; stages are shared-space addresses.

// Words of one stage: SOURCES x 8 runs (projection x 8 k tiles) of 8 consecutive n tiles, 64K words each,
// stored in that order, so piece i of the stage lands at word 4i.
// ACTIVE false: an empty stream, for kernels that take the other path.
template <int K, int SOURCES, int THREADS, bool ACTIVE = true>
struct WeightStream {
  static constexpr int kPieces = 16 * K;  // 16-byte pieces in a run of 8 tiles
  static constexpr int kTotal = SOURCES * 8 * kPieces;
  static constexpr int kItems = ACTIVE ? (kTotal + THREADS - 1) / THREADS : 0;
  const uint32_t* src[kItems > 0 ? kItems : 1];
  uint32_t step;  // words from one chunk to the next (32 bits keep the pointer step to one wide multiply-add)
  int32_t block_step;  // FC2: words from a block's last chunk to the next block's first

  __device__ __forceinline__ WeightStream(const uint32_t* first, size_t kt_stride, size_t source_stride,
                                          uint32_t chunk_step, int32_t next_block_step = 0)
      : step(chunk_step), block_step(next_block_step) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * THREADS;
      const int run = i / kPieces, piece = i - run * kPieces;
      src[j] = first + (run >> 3) * source_stride + (run & 7) * kt_stride + piece * 4;
    }
  }
  __device__ __forceinline__ void issue_next(uint32_t stage) { issue_then_step(stage, step); }
  // FC2: after a block's last chunk, on to the next block's first.
  __device__ __forceinline__ void issue_next(uint32_t stage, bool block_ends) {
    issue_then_step(stage, block_ends ? block_step : int32_t(step));
  }

 private:
  template <typename Step>
  __device__ __forceinline__ void issue_then_step(uint32_t stage, Step next) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if (kTotal % THREADS == 0 || i < kTotal) cp_async16(stage + 16u * i, src[j]);
      src[j] += next;
    }
  }
};

// A rows [rows][128 * a_expand] fp16 of SOURCES matrices (`source_stride` halves apart, rows `row_stride`
// apart) into [source][R*16][a_stride]; rows past `rows` are never written.
template <int R, int SOURCES, int THREADS, bool ACTIVE = true>
struct RowStream {
  static constexpr int kPieces = 16 * a_expand(R), kStride = a_stride(R), kPerSource = R * 16 * kPieces;
  static constexpr int kTotal = SOURCES * kPerSource;
  static constexpr int kItems = ACTIVE ? (kTotal + THREADS - 1) / THREADS : 0;
  static constexpr int kStep = 128 * a_expand(R);  // halves from one chunk to the next
  const __half* src[kItems > 0 ? kItems : 1];
  uint32_t dst[kItems > 0 ? kItems : 1];  // bytes from the stage's start
  bool live[kItems > 0 ? kItems : 1];
  int32_t block_step;  // FC2: halves from a block's last chunk back to its first (the next block's rows)

  __device__ __forceinline__ RowStream(const __half* first, size_t source_stride, size_t row_stride, int rows,
                                       int block_chunks = 1)
      : block_step((1 - block_chunks) * kStep) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * THREADS;
      const int p = i / kPerSource, rest = i % kPerSource, r = rest / kPieces, ch = rest % kPieces;
      live[j] = (kTotal % THREADS == 0 || i < kTotal) && r < rows;
      src[j] = first + p * source_stride + r * row_stride + ch * 8;
      dst[j] = 2u * ((p * R * 16 + r) * kStride + ch * 8);
    }
  }
  // Rows kept per route (route_rows): row r of the tile is route slot_route[first_slot + r], or its token
  // (rows_by_token), `row_stride` halves per row. Called once the route pack has finished.
  __device__ __forceinline__ void rows_by_route(const TrellisMoeArgs& a, int first_slot, size_t row_stride) {
    const bool by_token = rows_by_token(a);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * THREADS, r = (i % kPerSource) / kPieces, slot = first_slot + r;
      if (!live[j]) continue;
      const size_t row = by_token ? slot_token(a, slot) : size_t(static_cast<const int*>(a.slot_route)[slot]);
      src[j] += (ptrdiff_t(row) - r) * ptrdiff_t(row_stride);
    }
  }
  // block_ends (FC2): after a block's last chunk, back to the first, the same rows serving the next block.
  __device__ __forceinline__ void issue_next(uint32_t stage, bool block_ends = false) {
    const int32_t next = block_ends ? block_step : kStep;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (live[j]) cp_async16(stage + dst[j], src[j]);
      src[j] += next;
    }
  }
};

// The same copies for large tiles, which are short of registers: a 32-bit offset per piece from the
// chunk's first word, and A-row addresses recomputed per chunk (powers of two only).
template <int K, int SOURCES, int THREADS>
struct WeightIssue {
  static constexpr int kPieces = 16 * K;  // 16-byte pieces in a run of 8 tiles
  static constexpr int kTotal = SOURCES * 8 * kPieces;
  static constexpr int kItems = (kTotal + THREADS - 1) / THREADS;
  uint32_t src[kItems];  // word offset from the chunk's first word of source 0

  __device__ __forceinline__ WeightIssue(size_t kt_stride, size_t source_stride) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * THREADS;
      const int run = i / kPieces, piece = i - run * kPieces;
      const int p = run >> 3, kt = run & 7;
      src[j] = uint32_t(p * source_stride + kt * kt_stride + piece * 4);
    }
  }
  __device__ __forceinline__ void issue(uint32_t* dst, const uint32_t* chunk_src) const {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if (kTotal % THREADS == 0 || i < kTotal) cp_async16(dst + 4 * i, chunk_src + src[j]);
    }
  }
};

// A rows [rows][128 * a_expand] fp16 of `sources` matrices (row stride `src_stride` halves) into
// [source][R*16][a_stride].
// Every index is a power of two (rows past `rows` are skipped), so no runtime division.
// ROLLED keeps the loop rolled: the all-K large-tile kernels have no registers for unrolled addresses.
template <int R, int SOURCES, int THREADS, bool ROLLED = false>
__device__ __forceinline__ void issue_a_rows(__half* dst, const __half* src0, const __half* src1, size_t src_stride,
                                             int rows) {
  constexpr int kPieces = 16 * a_expand(R), kStride = a_stride(R), kPerSource = R * 16 * kPieces;
  constexpr int kTotal = SOURCES * kPerSource;
  auto piece = [&](int i) {
    const int p = i / kPerSource, rest = i % kPerSource, r = rest / kPieces, ch = rest % kPieces;
    if ((kTotal % THREADS == 0 || i < kTotal) && r < rows)
      cp_async16(dst + (p * R * 16 + r) * kStride + ch * 8, (p ? src1 : src0) + r * src_stride + ch * 8);
  };
  if (ROLLED) {
#pragma unroll 1
    for (int j = 0; j < (kTotal + THREADS - 1) / THREADS; ++j) piece(threadIdx.x + j * THREADS);
  } else {
#pragma unroll
    for (int j = 0; j < (kTotal + THREADS - 1) / THREADS; ++j) piece(threadIdx.x + j * THREADS);
  }
}

// Decode the 8 k tiles of n tile `ntl` from a staged run and multiply them into the live route blocks.
//
// Small tiles (split words) run the product transposed, y^T = W^T x^T: the lane's 8 codebook words are,
// reordered, its A fragments of W^T (16 features x 32 expanded k: even states, then odd states), and the
// tile's routes are the MMA's n = 8. acc[r][h] holds routes 16r + 8h .. +7 and `live` counts those 8-route
// blocks, so a tile of up to 8 routes takes 2 MMAs per weight tile where a 16-row A block took 4.
// Large tiles (merged fp16 weights) keep W as B against 16-row A blocks: acc[r][n] holds routes
// 16r .. 16r + 15 and features 8n .. 8n + 7 of the n tile, and `live` counts m16 blocks.
// a_addr: this lane's ldmatrix address for k tile 0 (a_lane_address).
template <int K, int CB, int R>
__device__ __forceinline__ void chunk_mma(const uint32_t* run, int ntl, const LaneWindow& win, uint32_t a_addr,
                                          int live, float (&acc)[R][2][4]) {
  constexpr int kAStride = a_stride(R);
  // The lane's words of k tile 0; k tile kt is a constant offset away (folds into the LDS).
  const uint32_t* w0 = run + ntl * 8 * K + win.w0;
  const uint32_t* w1 = run + ntl * 8 * K + win.w1;
  const uint32_t* w2 = run + ntl * 8 * K + win.w2;
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    TileWords t;
    t.u0 = w0[kt * 64 * K];
    t.u1 = w1[kt * 64 * K];
    t.u2 = K >= 5 ? w2[kt * 64 * K] : 0u;
    if (a_expand(R) == 2) {
      uint32_t x[8];
      decode_words<K, CB>(t, win, x);
      // As B, word j sat at k rows 2t | 2t+8 and n column g | g+8; as A of W^T the same words are rows
      // g | g+8 at those k.
      const uint32_t even[4] = {x[0], x[4], x[2], x[6]}, odd[4] = {x[1], x[5], x[3], x[7]};
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (2 * r + h < live) {
            uint32_t routes[4];  // 8 routes x 32 expanded k: the even k16 in [0], [1], the odd in [2], [3]
            ldmatrix_x4(routes, a_addr + 2 * ((16 * r + 8 * h) * kAStride + kt * 32));
            mma_16816(acc[r][h], even, routes[0], routes[1]);
            mma_16816(acc[r][h], odd, routes[2], routes[3]);
          }
        }
      }
      continue;
    }
    uint32_t b[4];
    decode_fragments<K, CB>(t, win, b);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < live) {
        uint32_t af[4];
        ldmatrix_x4(af, a_addr + 2 * (r * 16 * kAStride + kt * 16));
        mma_16816(acc[r][0], af, b[0], b[1]);
        mma_16816(acc[r][1], af, b[2], b[3]);
      }
    }
  }
}

// The blocks of a tile of `rows` routes that chunk_mma multiplies: 8-route blocks for small tiles, m16
// blocks for large ones.
template <int R>
__device__ __forceinline__ int live_blocks(int rows) {
  return small_tile(R) ? (rows + 7) >> 3 : (rows + 15) >> 4;
}

// Rows past the tile's routes, up to its last live block, stay zero in every stage (cp.async never writes
// them).
template <int R>
__device__ __forceinline__ void zero_dead_rows(__half* a, int sources, int rows) {
  constexpr int kPieces = 16 * a_expand(R), kStride = a_stride(R);
  const int dead = live_blocks<R>(rows) * (small_tile(R) ? 8 : 16) - rows;
  for (int i = threadIdx.x; i < sources * dead * kPieces; i += blockDim.x) {
    const int p = i / (dead * kPieces), rest = i - p * dead * kPieces;
    *reinterpret_cast<uint4*>(a + (p * R * 16 + rows + rest / kPieces) * kStride + (rest % kPieces) * 8) =
        make_uint4(0u, 0u, 0u, 0u);
  }
}

// The lane's ldmatrix address in a staged tile of rows at shared address `tile` (rows a_stride(R) halves
// apart). Small tiles, B of 8 routes x 32 expanded k: lane l names route l % 8, columns 8 * (l / 8) on.
// Large tiles, A of 16 routes x 16 k: lane l names route l % 16, columns 8 * (l / 16) on.
template <int R>
__device__ __forceinline__ uint32_t a_lane_address(uint32_t tile, int lane) {
  if (small_tile(R)) return tile + 2 * ((lane & 7) * a_stride(R) + (lane >> 3) * 8);
  return tile + 2 * ((lane & 15) * a_stride(R) + (lane >> 4) * 8);
}

// Where a small tile's accumulator acc[r][h][e] (chunk_mma, transposed) belongs, for lane 4g + q: route
// 16r + 8h + 2q + e % 2 of the tile, feature g + 8 (e / 2) of the warp's 16.
__host__ __device__ constexpr int small_acc_route(int r, int h, int e, int q) { return 16 * r + 8 * h + 2 * q + (e & 1); }
__host__ __device__ constexpr int small_acc_feature(int e, int g) { return g + 8 * (e >> 1); }

// Calls f(route, feature, value) for each of the lane's accumulators of a small tile whose route is below
// `rows`: the route within the tile, the feature within the warp's 16.
template <int R, typename F>
__device__ __forceinline__ void for_each_small_acc(const float (&acc)[R][2][4], int lane, int rows, F&& f) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int route = small_acc_route(r, h, e, q);
        if (route < rows) f(route, small_acc_feature(e, g), acc[r][h][e]);
      }
}

template <int R>
__device__ __forceinline__ void zero_acc(float (&acc)[R][2][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;
}

// Hides how v was computed, so the compiler keeps it in a register instead of recomputing it from the lane
// index at every use (which it does inside FC2's block loop: 4 instructions per ldmatrix).
template <typename T>
__device__ __forceinline__ void opaque(T& v) {
  asm volatile("" : "+r"(v));
}

__host__ __device__ constexpr int max_k(bool fast) { return fast ? 4 : 8; }
__host__ __device__ constexpr int fc1_stages(int r) { return r == 1 ? 3 : 2; }
// FC2 walks only I/128 chunks per output block (4 at I = 512). K3/K4 tiles keep 2 stages: large ones so
// that two CTAs (16 warps) share an SM (one CTA of 8 warps per SM left the 128-row FC2 latency-bound),
// 16-row ones so that an output block's 4 chunks start at stage 0 and a CTA can walk several blocks with
// its stages known at compile time (fc2_body).
__host__ __device__ constexpr int fc2_stages(int r, bool fast) { return fast ? 2 : 3; }
__host__ __device__ constexpr int fc1_stage_weight_words(bool fast) { return 2 * 8 * 64 * max_k(fast); }
__host__ __device__ constexpr int fc1_stage_a_halves(int r) { return 2 * r * 16 * a_stride(r); }
__host__ __device__ constexpr int fc2_stage_weight_words(bool fast) { return 8 * 64 * max_k(fast); }
__host__ __device__ constexpr int fc2_stage_a_halves(int r) { return r * 16 * a_stride(r); }
// Direct mode keeps FC1's one input row resident in the (then unused) A ring: per projection and chunk
// 256 expanded halves, plus one zero row that the other 15 lanes of each ldmatrix read.
constexpr int kDirectMaxChunks = 48;
static_assert((2 * kDirectMaxChunks + 1) * 256 <= fc1_stages(1) * fc1_stage_a_halves(1), "direct rows exceed the A ring");

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
  constexpr int kStages = fc1_stages(R);
  constexpr int kWeightWords = fc1_stage_weight_words(FAST), kAHalves = fc1_stage_a_halves(R);
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
    for (int st = 0; st < kStages; ++st) zero_dead_rows<R>(s_a + st * kAHalves, 2, w.rows);
  // Small tiles use the streams; large tiles the register-lean issue (the objects a kernel does not use
  // are compiled away).
  WeightStream<K, 2, kFc1Threads, small_tile(R)> weight_stream(gate_w + size_t(kc0) * 8 * kt_stride, kt_stride,
                                                size_t(up_w - gate_w), uint32_t(8 * kt_stride));
  RowStream<R, 2, kFc1Threads, small_tile(R)> row_stream(xrot + kc0 * 128 * kX, size_t(kX) * a.hidden, size_t(2) * kX * a.hidden,
                                          direct ? 0 : w.rows);
  const WeightIssue<K, 2, kFc1Threads> weights(kt_stride, size_t(up_w - gate_w));
  const uint32_t w_ring = shared_address(s_w), a_ring = shared_address(s_a);
  auto issue_w = [&](int c, int stage) {
    if (small_tile(R)) weight_stream.issue_next(w_ring + stage * kWeightWords * 4);
    else weights.issue(s_w + stage * kWeightWords, gate_w + size_t(kc0 + c) * 8 * kt_stride);
  };
  auto issue_a = [&](int c, int stage) {
    const int kc = kc0 + c;
    if (small_tile(R)) row_stream.issue_next(a_ring + stage * kAHalves * 2);
    else issue_a_rows<R, 2, kFc1Threads, !FAST>(s_a + stage * kAHalves, xrot + kc * 128 * kX,
                                         xrot + kX * a.hidden + kc * 128 * kX, size_t(2) * kX * a.hidden, w.rows);
  };
  float acc[R][2][4];
  zero_acc<R>(acc);
  // Direct mode: lanes 0, 8, 16 and 24 (route 0 of each ldmatrix matrix) read the resident row of this
  // projection, the others the zero row.
  const uint32_t direct_row = a_ring + 2 * ((lane & 7) ? 2 * chunks * 256 : proj * chunks * 256) + 16 * (lane >> 3);
  const uint32_t ring_lane = a_lane_address<R>(a_ring + 2 * proj * R * 16 * a_stride(R), lane);
  staged_chunks<kStages, small_tile(R)>(
      chunks, issue_w, issue_a,
      [&] {
        after_predecessor();
        if (by_route)
          row_stream.rows_by_route(a, w.start, size_t(2) * kX * a.hidden);
        if (direct) rotate_direct_row(a, w, kc0, chunks, s_a);  // made visible by the loop's first barrier
        timeline_mark(0);
      },
      [&](int c, int st) {
        const uint32_t a_addr =
            direct ? direct_row + ((lane & 7) ? 0 : 512 * c)
            : small_tile(R)
                ? ring_lane + 2 * st * kAHalves  // constant st: an immediate
                : a_lane_address<R>(a_ring + 2 * (st * kAHalves + proj * R * 16 * a_stride(R)), lane);
        chunk_mma<K, CB, R>(s_w + st * kWeightWords + proj * 8 * 64 * K, ntl, win, a_addr, live, acc);
        if (c == 0) timeline_mark(1);
      });
  timeline_mark(2);

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

// Calls body(IntConst<K>{}) for the tile's K. FAST: the tiers use only K3 and K4. Register allocation is the
// maximum over every compiled K, so a kernel holding just those two fits 2 CTAs (32 warps) per SM where
// the all-K kernel fits one.
template <int V>
struct IntConst {
  static constexpr int value = V;
};
template <bool FAST, typename Body>
__device__ __forceinline__ void with_k(int k, Body&& body) {
  if (FAST) {
    if (k == 3) body(IntConst<3>{});
    else body(IntConst<4>{});
    return;
  }
  switch (k) {
    case 1: body(IntConst<1>{}); break;
    case 2: body(IntConst<2>{}); break;
    case 3: body(IntConst<3>{}); break;
    case 4: body(IntConst<4>{}); break;
    case 5: body(IntConst<5>{}); break;
    case 6: body(IntConst<6>{}); break;
    case 7: body(IntConst<7>{}); break;
    case 8: body(IntConst<8>{}); break;
    default: break;
  }
}

template <int CB, int R, bool FAST>
__global__ void __launch_bounds__(kFc1Threads, (small_tile(R) && FAST) ? 2 : 1)
    fc1_kernel(const TrellisMoeArgs a, const Fc1Pieces pieces) {
  TRELLIS_TIMELINE_SCOPE(kTlFc1);
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

__host__ __device__ constexpr int fc1_smem_bytes(int r, bool fast) {
  return fc1_stages(r) * (fc1_stage_weight_words(fast) * 4 + fc1_stage_a_halves(r) * 2);
}

// ---------------------------------------------------------------------------------------------------
// Input rotation, once per route: xrot[slot][p] = fp16(H128(x[token] ⊙ suh_p)) for p = gate, up, in the
// FC1 kernel's A layout (every column once for 128-row tiles, twice for 16- and 32-row tiles).

// 128-row tiles: grid (tiles, H / (128 * blocks)), 8 warps, each CTA `blocks` (1, 2 or 4) column blocks of
// 128: more than one where the tiles hold few rows (M=512: about 16), so the CTA's groups have work. Each
// group of 4 lanes rotates one (row, block, projection) per step, 32 columns per lane in runs of 8: half
// the shuffles of 16-lane groups and fewer instructions (the kernel is issue-bound, not memory-bound).
// The two projections of a row sit in neighbouring groups, so their loads of x meet
// in the same sectors.
constexpr int kMaxRotateBlocks = 4;
template <bool kBf16>
__global__ void __launch_bounds__(256, 4) rotate_input_kernel(const TrellisMoeArgs a) {
  TRELLIS_TIMELINE_SCOPE(kTlRotate);
  constexpr int G = 4, N = 128 / G, kItemsPerWarp = 16 / G;
  // The CTA's suh columns of both projections, times 1/sqrt(128); the pad of 4 floats puts the two
  // projections' 16-byte reads in different banks.
  __shared__ __align__(16) float s_suh[kMaxRotateBlocks][2][132];
  after_predecessor();  // the tile list comes from the route pack, launched just before
  WorkTile w;
  if (!load_work_tile(a, blockIdx.x, w)) return;
  const int log2_blocks = __ffs((a.hidden >> 7) / gridDim.y) - 1;  // rotation_for: 1, 2 or 4 blocks
  const int block0 = blockIdx.y << log2_blocks;
  if (threadIdx.x < (32 << log2_blocks)) {
    const int b = threadIdx.x >> 5, p = (threadIdx.x >> 4) & 1, c = 8 * (threadIdx.x & 15);
    input_suh8(a, w.expert, p, (block0 + b) * 128 + c, &s_suh[b][p][c]);
  }
  __syncthreads();
  const int q = threadIdx.x % G, group = threadIdx.x / G, warp = warp_index();
  const int p = group & 1;
  const int items = w.rows << log2_blocks;  // item = row * blocks + block
  // Whole warps step together (the shuffles name the whole warp); a group past the tile's items idles.
  for (int i0 = kItemsPerWarp * warp; i0 < items; i0 += 8 * kItemsPerWarp) {
    const int item = i0 + (group >> 1) % kItemsPerWarp;
    const bool live = item < items;
    const int row = item >> log2_blocks, b = item & ((1 << log2_blocks) - 1);
    const int col0 = (block0 + b) * 128;
    float v[N];
    if (live) {
      const size_t token = slot_token(a, w.start + row);
#pragma unroll
      for (int j = 0; j < N / 8; ++j) load_x8(a, kBf16, token, col0 + 8 * G * j + 8 * q, v + 8 * j);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 s = *reinterpret_cast<const float4*>(&s_suh[b][p][8 * G * (i / 8) + 8 * q + i % 8]);
      v[i] *= s.x;
      v[i + 1] *= s.y;
      v[i + 2] *= s.z;
      v[i + 3] *= s.w;
    }
    hadamard128_unscaled<G>(v, q);
    if (live) {
      __half* dst = static_cast<__half*>(a.xrot) + (size_t(w.start + row) * 2 + p) * a.hidden;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) store_a_row8(dst, col0 + 8 * G * j + 8 * q, 1, v + 8 * j);
    }
  }
}

// 16- and 32-row tiles hold a route or two each at small M, so a CTA per (tile, 128 columns) kept most of
// its warps idle (M=8: 3264 CTAs for 64 routes, 11 µs on the critical path). Here a CTA takes
// kSmallRotateBlocks column blocks of one route: grid (routes, ceil(H / (128 * kSmallRotateBlocks))), 8
// warps, one column block each, a half warp per projection, 8 columns per lane (rotate8), suh read
// straight from global memory. Rows are kept per route (route_rows), so the kernel needs nothing from the
// route pack: it rotates while the pack runs and waits for the pack only before it lets FC1 launch (FC1
// reads the tile list before its own wait; launching the rotation before the pack let FC1 read the list
// before it was written). With rows_by_token the grid's x
// is the token and the rows are plain for 128-row tiles.
constexpr int kSmallRotateBlocks = 8;
template <bool kBf16>
__global__ void __launch_bounds__(256) rotate_routes_kernel(const TrellisMoeArgs a) {
  TRELLIS_TIMELINE_SCOPE(kTlRotate);
  const int row = blockIdx.x, lane = threadIdx.x & 15, p = (threadIdx.x >> 4) & 1, warp = warp_index();
  const int col = (blockIdx.y * kSmallRotateBlocks + warp) * 128 + 8 * lane;
  const bool by_token = rows_by_token(a);
  const int expert = by_token ? 0 : route_combined(a, row);  // by token: the shared suh rows
  const int expand = expand_of_m_tile(a.m_tile);
  if (col < a.hidden && expert >= 0) {  // a route not served here: FC1 never reads its row
    float x[8], s[8], v[8];
    load_x8(a, kBf16, by_token ? row : row / a.top_k, col, x);
    input_suh8(a, expert, p, col, s);
    rotate8(x, s, lane, v);
    store_a_row8(static_cast<__half*>(a.xrot) + (size_t(row) * 2 + p) * expand * a.hidden, col, expand, v);
  }
  after_predecessor();
}

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
  constexpr int kWeightWords = fc2_stage_weight_words(FAST), kAHalves = fc2_stage_a_halves(R);
  uint32_t* s_w = reinterpret_cast<uint32_t*>(smem);
  __half* s_a = reinterpret_cast<__half*>(smem + kFc2Stages * kWeightWords * 4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_tiles = a.hidden >> 4;
  const size_t kt_stride = size_t(n_tiles) * 8 * K;
  LaneWindow win = lane_window<K>(lane);
  opaque(win.w0), opaque(win.w1), opaque(win.off);
  const int live = live_blocks<R>(w.rows);
  const int block_chunks = a.intermediate >> 7;
  const uint32_t* wsrc = projection_words<K>(a, w, 2) + size_t(first_block) * 8 * 8 * K;
  constexpr int kX = a_expand(R);
  const __half* act = static_cast<const __half*>(a.act) + size_t(w.start) * kX * a.intermediate;

  for (int st = 0; st < kFc2Stages; ++st) zero_dead_rows<R>(s_a + st * kAHalves, 1, w.rows);
  // Small tiles (as in FC1); after a block's last chunk the weights go on 128 columns, from k = 0.
  WeightStream<K, 1, kFc2Threads, small_tile(R)> weight_stream(
      wsrc, kt_stride, 0, uint32_t(8 * kt_stride), int32_t(8 * 8 * K) - int32_t((block_chunks - 1) * 8 * kt_stride));
  RowStream<R, 1, kFc2Threads, small_tile(R)> row_stream(act, 0, size_t(kX) * a.intermediate, w.rows, block_chunks);
  const WeightIssue<K, 1, kFc2Threads> weights(kt_stride, 0);
  const uint32_t w_ring = shared_address(s_w), a_ring = shared_address(s_a);
  // Spans exist only where I/128 is a power of two (fc2_span), so the test needs no division; otherwise the
  // mask is all ones and no chunk ends a block early.
  const int block_mask = (block_chunks & (block_chunks - 1)) ? -1 : block_chunks - 1;
  auto block_ends = [&](int c) { return ((c + 1) & block_mask) == 0; };
  auto issue_w = [&](int c, int stage) {
    if (small_tile(R)) weight_stream.issue_next(w_ring + stage * kWeightWords * 4, block_ends(c));
    else weights.issue(s_w + stage * kWeightWords, wsrc + size_t(c) * 8 * kt_stride);
  };
  auto issue_a = [&](int c, int stage) {
    if (small_tile(R)) {
      row_stream.issue_next(a_ring + stage * kAHalves * 2, block_ends(c));
    } else {
      issue_a_rows<R, 1, kFc2Threads, !FAST>(s_a + stage * kAHalves, act + c * 128 * kX, nullptr,
                                             size_t(kX) * a.intermediate, w.rows);
    }
  };
  float acc[R][2][4];
  zero_acc<R>(acc);
  uint32_t ring_lane = a_lane_address<R>(a_ring, lane);
  opaque(ring_lane);
  auto compute = [&](int c, int st) {
    const uint32_t a_addr =
        small_tile(R) ? ring_lane + 2 * st * kAHalves : a_lane_address<R>(a_ring + 2 * st * kAHalves, lane);
    chunk_mma<K, CB, R>(s_w + st * kWeightWords, warp, win, a_addr, live, acc);
    if (c == 0) timeline_mark(1);
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
    timeline_waited();
  };
  staged_blocks<kFc2Stages, small_tile(R)>(span, block_chunks, issue_w, issue_a, wait, compute, finish);
  timeline_mark(2);
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
  timeline_mark(3);
}

// Grid (tiles, groups): blockIdx.x is the tile, blockIdx.y its group of `span` = (H/128) / gridDim.y output
// blocks (always 1 for large tiles: the host sizes the grid).
template <int CB, int R, bool FAST>
__global__ void __launch_bounds__(kFc2Threads, FAST ? (small_tile(R) ? 4 : 2) : 1) fc2_kernel(const TrellisMoeArgs a) {
  TRELLIS_TIMELINE_SCOPE(kTlFc2);
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  WorkTile w;
  if (!load_work_tile(a, blockIdx.x, w)) return;
  const int span = (a.hidden >> 7) / gridDim.y;
  with_k<FAST>(w.k, [&](auto k) { fc2_body<CB, R, decltype(k)::value, FAST>(a, w, blockIdx.y * span, span, gemm_smem); });
}

__host__ __device__ constexpr int fc2_smem_bytes(int r, bool fast) {
  return (fc2_stages(r, fast) * (fc2_stage_weight_words(fast) * 4 + fc2_stage_a_halves(r) * 2) > r * 16 * kOStride * 4)
             ? fc2_stages(r, fast) * (fc2_stage_weight_words(fast) * 4 + fc2_stage_a_halves(r) * 2)
             : r * 16 * kOStride * 4;
}

}  // namespace trellis
