// How FC1's work is cut into CTAs: H ranges of items, finer at the end of the list.
//
// An FC1 item is one work tile's 256 features (mma_sync: gate and up of one 128-wide n block; wgmma: 256
// features of one projection) over the H / 128 chunks of the hidden dimension. Each CTA computes one piece:
// one H range of one item, into the plane of partial sums named by the range, and the activation adds an
// item's planes in order, so the result depends on the routes only, never on scheduling.
//
// The block scheduler hands pieces to SMs in grid order as SMs free up, so what it cannot balance is the
// last wave: with the plan's k_split ranges per item the SMs' last CTAs ended up to 26 us apart at M=16 and
// 50 us at M=256 (docs/performance.md, run 87). The pieces of the last half wave are therefore
// `tail_split` times shorter (M = 16-256: -2 to -5 %, runs 91-93). Cutting every item that fine pays a
// pipeline fill per piece instead; an equal run of chunks per CTA (stream-K) was slower still, because
// equal chunks are not equal time (K3 and K4, two CTAs sharing an SM; run 89).
#pragma once
#include "abi.h"
#include "handover.cuh"

namespace trellis {

// Features per FC1 item on wgmma (expert_wgmma.cuh kWgFeatures).
constexpr int kFc1WgmmaFeatures = 256;

// Whether FC1 and FC2 of this call run on the wgmma kernels (trellis_moe.cu launch_for_tile).
__host__ __device__ __forceinline__ bool gemms_on_wgmma(const TrellisMoeArgs& a) {
#ifdef TRELLIS_WGMMA
  return a.m_tile == 128 && a.hidden % kFc1WgmmaFeatures == 0 && a.intermediate % kFc1WgmmaFeatures == 0;
#else
  return false;
#endif
}

__host__ __device__ __forceinline__ int fc1_items_per_tile(const TrellisMoeArgs& a) {
  return gemms_on_wgmma(a) ? 2 * (a.intermediate / kFc1WgmmaFeatures) : a.intermediate / 128;
}

// Pieces of the tail: each of the plan's k_split ranges of a tail item is cut in this many, where the
// ranges hold at least kFc1TailFromChunks chunks, the chunks divide, and each piece keeps at least
// kFc1MinTailChunks (plan.MIN_FC1_CHUNKS). Shorter ranges end their wave soon anyway: M=8's 12-chunk
// ranges lost 1 % cut in 2 or 4 (docs/performance.md, runs 92-93). Only small and mid tiles (two CTAs per
// SM) have a tail: large tiles run one CTA per SM, which pays each piece's pipeline fill alone (wgmma with
// 2 pieces: M=512 +2 %, M = 1024-3072 unchanged; run 91; the narrow wgmma kernels' two CTAs per SM came
// later and are untried with a tail). Direct mode has none either.
// trellis_cli/kernel/plan.py fc1_tail_split mirrors this for the planes of partial sums.
constexpr int kFc1MaxTailSplit = 4;
constexpr int kFc1TailFromChunks = 24;
constexpr int kFc1MinTailChunks = 6;
__host__ __device__ __forceinline__ int fc1_tail_split(const TrellisMoeArgs& a) {
  const int range = (a.hidden >> 7) / a.k_split;
  if (a.direct || a.m_tile > 32 || range < kFc1TailFromChunks) return 1;
  for (int s = kFc1MaxTailSplit; s > 1; s >>= 1)
    if (range % s == 0 && range / s >= kFc1MinTailChunks) return s;
  return 1;
}

// Chosen per call on the host (trellis_moe.cu fc1_pieces).
struct Fc1Pieces {
  int tail_items;  // items at the end of the list cut tail_split times finer: whole tiles' items
  int tail_split;
};

struct Fc1Piece {
  int item, kc0, chunks, plane;
};

// The tiles FC1 walks: the route pack's count, or every route in direct mode.
__device__ __forceinline__ int fc1_tiles(const TrellisMoeArgs& a) {
  return a.direct ? a.m * a.top_k : min(*static_cast<const int*>(a.tile_count), a.tile_capacity);
}

// First item of the tail.
__device__ __forceinline__ int fc1_tail_start(const TrellisMoeArgs& a, const Fc1Pieces& p) {
  const int items = fc1_tiles(a) * fc1_items_per_tile(a);
  return max(0, items - p.tail_items);
}

// Piece `index` of the grid; false past the last piece. Listed range by range, or item by item where the
// phases hand over per tile (handover.cuh), so that a tile's pieces are placed together. Direct mode:
// blockIdx.x is the item and blockIdx.y the range, or the other way round.
__device__ __forceinline__ bool fc1_piece(const TrellisMoeArgs& a, const Fc1Pieces& p, Fc1Piece& out) {
  const int chunks = a.hidden >> 7, ranges = a.k_split;
  if (a.direct) {
    const bool by_item = tile_handover(a);
    const int item = by_item ? blockIdx.y : blockIdx.x, range = by_item ? blockIdx.x : blockIdx.y;
    out = {item, range * (chunks / ranges), chunks / ranges, range};
    return true;
  }
  const int items = fc1_tiles(a) * fc1_items_per_tile(a), head = max(0, items - p.tail_items);
  const int index = blockIdx.x;
  const bool by_item = tile_handover(a);
  if (index < head * ranges) {
    const int r = by_item ? index % ranges : index / head, item = by_item ? index / ranges : index - r * head;
    out = {item, r * (chunks / ranges), chunks / ranges, r};
    return true;
  }
  const int tail = items - head, fine = ranges * p.tail_split, q = index - head * ranges;  // the tail's pieces
  if (q >= tail * fine) return false;
  const int r = by_item ? q % fine : q / tail, item = head + (by_item ? q / fine : q - r * tail);
  out = {item, r * (chunks / fine), chunks / fine, r};
  return true;
}

// Planes the activation adds for the items of work tile `tile` (the tail holds whole tiles).
__device__ __forceinline__ int fc1_tile_planes(const TrellisMoeArgs& a, const Fc1Pieces& p, int tile) {
  return tile * fc1_items_per_tile(a) < fc1_tail_start(a, p) ? a.k_split : a.k_split * p.tail_split;
}

}  // namespace trellis
