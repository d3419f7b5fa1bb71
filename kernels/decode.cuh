// Trellis tile decode straight into mma.m16n8k16 B fragments (exl3-format.md §2-§3).
//
// Lane l of a warp decodes stream positions 8l..8l+7 of a 16x16 tile. By the format's tensor-core
// permutation those are exactly the lane's B fragments of two m16n8k16 MMAs (n columns 0-7 and 8-15), so
// decoded values go to registers with no shuffle and no shared memory. The 8 states of a lane come from
// one window of 16 + 7K stream bits, which lies in 2 (K <= 4) or 3 (K >= 5) consecutive 32-bit words.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace trellis {

// Where a lane's window starts inside a tile of 8K 32-bit words: the same for every tile.
struct LaneWindow {
  int w0, w1, w2;  // word indices (cyclic: tail-biting)
  int off;         // bit offset of the window inside word w0, counted from its MSB
};

template <int K>
__device__ __forceinline__ LaneWindow lane_window(int lane) {
  constexpr int kBits = 256 * K;
  constexpr int kWords = 8 * K;
  const int start = ((8 * lane + 1) * K - 16 + kBits) % kBits;
  LaneWindow w;
  w.w0 = start >> 5;
  w.off = start & 31;
  w.w1 = (w.w0 + 1) % kWords;
  w.w2 = (w.w0 + 2) % kWords;
  return w;
}

// The lane's raw words of one tile.
struct TileWords {
  uint32_t u0, u1, u2;
};

template <int K>
__device__ __forceinline__ TileWords load_tile_words(const uint32_t* __restrict__ tile, const LaneWindow& w) {
  TileWords t;
  t.u0 = __ldg(tile + w.w0);
  t.u1 = __ldg(tile + w.w1);
  t.u2 = (K >= 5) ? __ldg(tile + w.w2) : 0u;
  return t;
}

// State j (0..7) of the lane: 16 bits starting `off + j*K` bits after the MSB of u0.
template <int K>
__device__ __forceinline__ uint32_t lane_state(const TileWords& t, int off, int j) {
  const int p = off + j * K;
  const uint64_t hi = (uint64_t(t.u0) << 32) | t.u1;
  if (K <= 4) return uint32_t(hi >> (48 - p)) & 0xFFFFu;
  const uint64_t lo = (uint64_t(t.u1) << 32) | t.u2;
  return (p <= 48 ? uint32_t(hi >> (48 - p)) : uint32_t(lo >> (80 - p))) & 0xFFFFu;
}

// Bytes 1-2 of x as a 16-bit value: (x >> 8) & 0xFFFF in one PRMT.
__device__ __forceinline__ uint32_t bytes12(uint32_t x) { return __byte_perm(x, 0u, 0x4421); }

// Bits N .. N+15 of x: a left shift that drops the bits above them, as IMAD.SHL (a multiply by 2^(16-N),
// which runs on the FMA-heavy pipe), then a right shift by 16 on the ALU. The same two instructions as a
// shift and a mask, but one of them off the ALU pipe, which binds the decode (docs/kernel.md "The decode
// budget": IMAD.SHL issues at full rate beside LOP3, where IMAD.HI takes two issue slots).
template <int N>
__device__ __forceinline__ uint32_t bits16_at(uint32_t x) {
  static_assert(N >= 0 && N < 16, "a 16-bit field inside one word, below bit 16");
  uint32_t y;
  asm("mul.lo.u32 %0, %1, %2;" : "=r"(y) : "r"(x), "n"(1u << (16 - N)));
  return y >> 16;
}

// All 8 states of the lane at once, with the fewest instructions on the ALU pipe, which binds the decode
// loops: the FMA-heavy pipe beside it issues IMAD and IMAD.SHL at the same rate, and the loops leave it
// half idle (docs/kernel.md "The decode budget").
// K4 windows start at bit 20 of w0 in every lane, so half the states are byte-aligned (one PRMT each, the
// one across the two words with the zero bytes of state 3); states 4 and 6 are cut out by bits16_at: 11
// instructions for 8 states, 9 of them on the ALU. K3 windows (37 bits) start at bit 3, 11, 19 or 27 (by
// lane): two funnel shifts give its first and its last 32 bits; state 0 is a shift of the first, state 7 a
// mask of the last, states 1-6 bits16_at: 16 instructions, 10 on the ALU (a shift and a mask each put all
// 16 there). Both equal lane_state (the GPU stage checks compare every stage with the CPU decoder); other
// K use lane_state.
template <int K>
__device__ __forceinline__ void lane_states(const TileWords& t, const LaneWindow& win, uint32_t s[8]) {
  if (K == 4) {  // s_j = (u0:u1 >> (28 - 4j)) & 0xFFFF
    const uint32_t b = __funnelshift_r(t.u1, t.u0, 20);
    s[0] = bytes12(b);
    s[3] = t.u1 >> 16;
    s[1] = __byte_perm(s[3], t.u0, 0x3241);  // u1's byte 3, u0's byte 0, then s3's two zero bytes
    s[2] = b & 0xFFFFu;
    s[4] = bits16_at<12>(t.u1);
    s[5] = bytes12(t.u1);
    s[6] = bits16_at<4>(t.u1);
    s[7] = t.u1 & 0xFFFFu;
  } else if (K == 3) {  // s_j = window bits 3j .. 3j + 15
    const uint32_t head = __funnelshift_l(t.u1, t.u0, win.off);       // window bits 0 .. 31
    const uint32_t tail = __funnelshift_lc(t.u1, t.u0, win.off + 5);  // bits 5 .. 36 (clamped: off + 5 may be 32)
    s[0] = head >> 16;
    s[1] = bits16_at<13>(head);
    s[2] = bits16_at<15>(tail);
    s[3] = bits16_at<12>(tail);
    s[4] = bits16_at<9>(tail);
    s[5] = bits16_at<6>(tail);
    s[6] = bits16_at<3>(tail);
    s[7] = tail & 0xFFFFu;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j] = lane_state<K>(t, win.off, j);
  }
}

__device__ __forceinline__ uint32_t lop3_and_xor(uint32_t x) {
  // (x & 0x8FFF8FFF) ^ 0x3B603B60 as one LOP3 (0x6A = (a & b) ^ c).
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(x), "r"(0x8FFF8FFFu), "r"(0x3B603B60u));
  return r;
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Two states -> packed half2 (first state in the low half). CB: 0 3INST, 1 mcg, 2 mul1 (§3).
template <int CB>
__device__ __forceinline__ uint32_t codebook_pair(uint32_t sa, uint32_t sb) {
  if (CB == 2) {
    const uint32_t xa = sa * 0x83DCD12Du, xb = sb * 0x83DCD12Du;
    const uint32_t ha = 0x6400u + __dp4a(xa, 0x01010101u, 0u);
    const uint32_t hb = 0x6400u + __dp4a(xb, 0x01010101u, 0u);
    const __half2 h = bits_half2(ha | (hb << 16));
    const __half2 scale = bits_half2(0x1EEE1EEEu), bias = bits_half2(0xC931C931u);
    return half2_bits(__hfma2(h, scale, bias));
  }
  uint32_t xa, xb;
  if (CB == 0) {
    xa = sa * 89226354u + 64248484u;
    xb = sb * 89226354u + 64248484u;
  } else {
    xa = sa * 0xCBAC1FEDu;
    xb = sb * 0xCBAC1FEDu;
  }
  // h0 + h1 of each word by one HADD2 whose operands select its low and its high half (no instruction),
  // then one PRMT pairs the two sums: 1 integer instruction per pair, where pairing the halves of both
  // words first and adding once takes 2.
  const __half2 ha = bits_half2(lop3_and_xor(xa)), hb = bits_half2(lop3_and_xor(xb));
  const __half2 suma = __hadd2(__low2half2(ha), __high2half2(ha)), sumb = __hadd2(__low2half2(hb), __high2half2(hb));
  return __byte_perm(half2_bits(suma), half2_bits(sumb), 0x5410);
}

// The lane's 8 decoded weights as B fragments: b[0], b[1] for n columns 0-7; b[2], b[3] for 8-15.
template <int K, int CB>
__device__ __forceinline__ void decode_fragments(const TileWords& t, const LaneWindow& win, uint32_t b[4]) {
  uint32_t s[8];
  lane_states<K>(t, win, s);
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = codebook_pair<CB>(s[2 * i], s[2 * i + 1]);
}

// Split form, for small-M tiles: the format's weight is fp16(h0 + h1) of one 32-bit codebook word, and
// y = sum x (h0 + h1) = sum x h0 + sum x h1, so the word itself can be a B register (two k rows) against
// an activation whose columns are duplicated (expanded_col below). That drops the PRMT pairing and the
// HADD2 of every weight, at twice the MMA work (idle at small M) and without the fp16 rounding of the sum
// (the product is exact in the fp32 accumulator). mul1 has a single fp16 value: its word is (w, 0).
template <int CB>
__device__ __forceinline__ uint32_t codebook_word(uint32_t s) {
  if (CB == 2) {
    const uint32_t h = __dp4a(s * 0x83DCD12Du, 0x01010101u, 0x6400u);
    return half2_bits(__hfma2(bits_half2(h), bits_half2(0x00001EEEu), bits_half2(0x0000C931u)));
  }
  const uint32_t x = CB == 0 ? s * 89226354u + 64248484u : s * 0xCBAC1FEDu;
  return lop3_and_xor(x);
}

// The lane's 8 codebook words: x[j] belongs to state j (k row and n column of B fragment j / 2).
template <int K, int CB>
__device__ __forceinline__ void decode_words(const TileWords& t, const LaneWindow& win, uint32_t x[8]) {
  lane_states<K>(t, win, x);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = codebook_word<CB>(x[j]);
}

// Expanded activation layout of one 16-column k tile (32 halves): first the even columns, each twice,
// then the odd columns, each twice. The m16n8k16 A fragment of the first half pairs with B registers of
// even states, the second half with odd states.
__host__ __device__ constexpr int expanded_col(int col) {
  return (col >> 4) * 32 + (col & 1) * 16 + ((col & 15) & ~1);
}

}  // namespace trellis
