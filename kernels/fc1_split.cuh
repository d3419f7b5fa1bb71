// How FC1's work is cut into CTAs: H ranges of items, finer at the end of the list.
//
// An FC1 item is one work tile's 256 features (mma_sync: gate and up of one 128-wide n block; wgmma: 256
// features of one projection) over the H / 128 chunks of the hidden dimension. Each CTA computes one piece:
// one H range of one item, into the plane of partial sums named by the range, and the activation adds an
// item's planes in order, so the result depends on the routes only, never on scheduling.
//
// The block scheduler hands pieces to SMs in grid order as SMs free up, so what it cannot balance is the
// last wave: with the plan's k_split ranges per item the SMs' last CTAs ended up to 26 us apart at M=16 and
// 50 us at M=256. The pieces of the last half wave are therefore
// `tail_split` times shorter where two or more CTAs share an SM (16- and 32-row tiles, M = 16-256: -2 to
// -5 %; the narrow wgmma kernels, M = 512-1024: -1 to -2 %). The plan picks the cut
// (args.fc1_tail_split, plan.py choose_fc1_tail_split) and sizes the planes of partial sums for it.
// Cutting every item that fine pays a pipeline fill per piece instead; an equal run of chunks per CTA
// (stream-K) was slower still, +1 to +17 %, because equal chunks are not equal time (a K3 chunk costs
// about 15 % more than a K4 one, and of two CTAs sharing an SM one runs ahead).
#pragma once
#include "abi.h"
#include "handover.cuh"
#include "tile_kernels.cuh"

namespace trellis {

__host__ __device__ __forceinline__ int fc1_items_per_tile(const TrellisMoeArgs& a) {
  return gemms_on_wgmma(a) ? 2 * (a.intermediate / kFc1WgmmaFeatures) : a.intermediate / 128;
}

// Chosen per call on the host (trellis_moe.cu fc1_pieces): tail_split is args.fc1_tail_split or 1.
struct Fc1Pieces {
  int tail_items;  // items at the end of the list cut tail_split times finer: whole tiles' items (at most)
  int tail_split;
};

struct Fc1Piece {
  int item, kc0, chunks, plane;
};

// The tiles FC1 walks: the route pack's count, or every route in direct mode.
__device__ __forceinline__ int fc1_tiles(const TrellisMoeArgs& a) {
  return a.direct ? a.m * a.top_k : min(*static_cast<const int*>(a.tile_count), a.tile_capacity);
}

// First item of the tail: tail_items before the end, moved forward to the first tile of an expert. A tile
// of the tail sums tail_split times more planes than one of the head, so the cut decides a route's rounding;
// inside an expert's segment routes sit in the order of atomics (route_pack.cuh), so a cut inside an expert
// would let a route change side, and its result change in the last bits, from one call to the next. Every
// route of an expert is summed alike when the cut falls between experts. The walk is over one expert's tiles.
__device__ __forceinline__ int fc1_tail_start(const TrellisMoeArgs& a, const Fc1Pieces& p) {
  const int per_tile = fc1_items_per_tile(a), tiles = fc1_tiles(a);
  int tile = max(0, tiles - p.tail_items / per_tile);  // tail_items holds whole tiles
  if (p.tail_split > 1) {
    const int* tile_expert = static_cast<const int*>(a.tile_expert);
    while (tile > 0 && tile < tiles && tile_expert[tile] == tile_expert[tile - 1]) ++tile;
  }
  return tile * per_tile;
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
  const int items = fc1_tiles(a) * fc1_items_per_tile(a), head = fc1_tail_start(a, p);
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
