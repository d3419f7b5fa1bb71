// The cp.async copy ring of the FC1 and FC2 kernels (expert_gemm.cuh): the chunk pipeline, the
// per-thread copy streams of weights and A rows, and the ring's stage sizes.
#pragma once
#include "gemm_tile.cuh"

namespace trellis {

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

// log2 of a chunk's k tiles (8, 4 or 2; fc1_chunk_tiles): runs of a stage split by shifts.
__host__ __device__ constexpr int log2_tiles(int kt) { return kt == 8 ? 3 : kt == 4 ? 2 : 1; }

// Each thread copies the same few 16-byte pieces of every chunk, from addresses that advance by a fixed
// step from one chunk to the next. The streams below work out a thread's pieces once and keep one global
// pointer and one shared offset per piece, so issuing a chunk costs a 64-bit add and a copy per piece,
// not a division chain. Chunks must be issued in order, each once; stages are shared-space addresses.

// Words of one stage: SOURCES x KT runs (projection x KT k tiles) of 8 consecutive n tiles, 64K words each,
// stored in that order, so piece i of the stage lands at word 4i.
// ACTIVE false: an empty stream, for kernels that take the other path.
template <int K, int SOURCES, int THREADS, bool ACTIVE = true, int KT = 8>
struct WeightStream {
  static constexpr int kPieces = 16 * K;  // 16-byte pieces in a run of 8 tiles
  static constexpr int kTotal = SOURCES * KT * kPieces;
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
      src[j] = first + (run >> log2_tiles(KT)) * source_stride + (run & (KT - 1)) * kt_stride + piece * 4;
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

// A rows [rows][16 * KT * a_expand] fp16 of SOURCES matrices (`source_stride` halves apart, rows `row_stride`
// apart) into [source][R*16][a_stride]; rows past `rows` are never written.
template <int R, int SOURCES, int THREADS, bool ACTIVE = true, int KT = 8>
struct RowStream {
  static constexpr int kPieces = 2 * KT * a_expand(R), kStride = a_stride(R, KT), kPerSource = R * 16 * kPieces;
  static constexpr int kTotal = SOURCES * kPerSource;
  static constexpr int kItems = ACTIVE ? (kTotal + THREADS - 1) / THREADS : 0;
  static constexpr int kStep = 16 * KT * a_expand(R);  // halves from one chunk to the next
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
template <int K, int SOURCES, int THREADS, int KT = 8>
struct WeightIssue {
  static constexpr int kPieces = 16 * K;  // 16-byte pieces in a run of 8 tiles
  static constexpr int kTotal = SOURCES * KT * kPieces;
  static constexpr int kItems = (kTotal + THREADS - 1) / THREADS;
  uint32_t src[kItems];  // word offset from the chunk's first word of source 0

  __device__ __forceinline__ WeightIssue(size_t kt_stride, size_t source_stride) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * THREADS;
      const int run = i / kPieces, piece = i - run * kPieces;
      const int p = run >> log2_tiles(KT), kt = run & (KT - 1);
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

// A rows [rows][16 * KT * a_expand] fp16 of `sources` matrices (row stride `src_stride` halves) into
// [source][R*16][a_stride].
// Every index is a power of two (rows past `rows` are skipped), so no runtime division.
// ROLLED keeps the loop rolled: the all-K large-tile kernels have no registers for unrolled addresses.
template <int R, int SOURCES, int THREADS, bool ROLLED = false, int KT = 8>
__device__ __forceinline__ void issue_a_rows(__half* dst, const __half* src0, const __half* src1, size_t src_stride,
                                             int rows) {
  constexpr int kPieces = 2 * KT * a_expand(R), kStride = a_stride(R, KT), kPerSource = R * 16 * kPieces;
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

__host__ __device__ constexpr int max_k(bool fast) { return fast ? 4 : 8; }
__host__ __device__ constexpr int fc1_stages(int r, bool fast) {
#ifndef TRELLIS_WGMMA
  if (r > 2) return compact_staging(fast).fc1_stages;
#endif
  return (void)fast, r == 1 ? 3 : 2;
}
// FC2 walks only I/128 chunks per output block (4 at I = 512). K3/K4 tiles keep 2 stages: large ones so
// that two CTAs (16 warps) share an SM (one CTA of 8 warps per SM left the 128-row FC2 latency-bound),
// 16-row ones so that an output block's 4 chunks start at stage 0 and a CTA can walk several blocks with
// its stages known at compile time (fc2_body).
__host__ __device__ constexpr int fc2_stages(int r, bool fast) {
#ifndef TRELLIS_WGMMA
  if (r > 2) return compact_staging(fast).fc2_stages;
#endif
  return (void)r, fast ? 2 : 3;
}
__host__ __device__ constexpr int fc1_stage_weight_words(int r, bool fast) {
  return 2 * fc1_chunk_tiles(r, fast) * 64 * max_k(fast);
}
__host__ __device__ constexpr int fc1_stage_a_halves(int r, bool fast) {
  return 2 * r * 16 * a_stride(r, fc1_chunk_tiles(r, fast));
}
__host__ __device__ constexpr int fc2_stage_weight_words(int r, bool fast) {
  return fc2_chunk_tiles(r, fast) * 64 * max_k(fast);
}
__host__ __device__ constexpr int fc2_stage_a_halves(int r, bool fast) {
  return r * 16 * a_stride(r, fc2_chunk_tiles(r, fast));
}

}  // namespace trellis
