// Which pipe each decode instruction issues on, and how fast, alone and beside LOP3: one kernel per case,
// named pf_<case>, for Nsight Compute to read the per-pipe counters of (lab/perf/pipe_facts.sh runs
// all of it: SASS check, ncu, table).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o pipe_facts lab/perf/probes/pipe_facts.cu && ./pipe_facts
//   ./pipe_facts --list    the cases, their payload per warp and the SASS each loop iteration must hold
//   ./pipe_facts --once    every case launched once, untimed (for ncu)
//
// Every case is a loop of 64 chain steps per iteration (`kSteps`), in CHAINS independent chains per
// thread, 256-thread blocks at 64 warps per SM unless the case says fewer. Operands are kernel-argument
// values in registers (or the decode's immediates, where the case says so), so ptxas can neither fold a
// chain nor hoist it; the chains end in one store per thread. The timed run reads each SM's own clock
// (clock64 around its blocks), so its warp instructions per clock per SM do not depend on the clock rate;
// beside it, the same count per clock of the attribute clock rate (what pipe_mix.cu reports). ptxas
// picks some opcodes itself (nvcc 13.0, sm_90a: half of the f16x2 fma/add become HFMA2.MMA, `mul.lo` by 16
// becomes SHF.L.U32 where IMAD is busy): the cases that allow both say A|B, and the check shows the split.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "check.cuh"

constexpr int kThreads = 256, kSteps = 64;

// The chains' state, from the seed: a/b/c 32-bit integer chains, f float chains, w 64-bit chains; k1..k4
// operands, s1/s2 shift counts and n1/n2 field widths (runtime values, for ptxas).
#define PF_PROLOGUE(CHAINS)                                                                        \
  const unsigned long long t0 = clock64();                                                          \
  const uint32_t k1 = seed | 1u, k2 = seed ^ 0x55AA55u, k3 = seed * 3u + 0x3C003C00u, k4 = seed + 0x01000100u; \
  const uint32_t s1 = (seed >> 8) & 31u, s2 = (seed >> 13) & 31u, n1 = 8u + (seed >> 20) % 8u, n2 = n1 + 4u; \
  (void)k1, (void)k2, (void)k3, (void)k4, (void)s1, (void)s2, (void)n1, (void)n2;                    \
  uint32_t a[CHAINS], b[CHAINS], c[CHAINS];                                                         \
  float f[CHAINS];                                                                                  \
  unsigned long long w[CHAINS];                                                                     \
  _Pragma("unroll") for (int i = 0; i < CHAINS; ++i) {                                              \
    a[i] = seed + threadIdx.x * 17u + i * 0x9E3779B9u;                                              \
    b[i] = a[i] ^ 0x35003500u;                                                                      \
    c[i] = a[i] + 0x01230123u;                                                                      \
    f[i] = __uint_as_float(0x3F800000u | (a[i] & 0x7FFFFFu));                                       \
    w[i] = a[i] | (static_cast<unsigned long long>(b[i]) << 32);                                    \
  }

// Fold the chains the body uses (USES: A B C F W bits) into one word per thread, so that the others hold
// no registers; thread 0 stamps its block's SM and clock span.
enum : int { A = 1, B = 2, C = 4, F = 8, W = 16 };
#define PF_EPILOGUE(CHAINS, USES)                                                                  \
  uint32_t r = s1 ^ s2 ^ n1 ^ n2 ^ k3 ^ k4;                                                         \
  _Pragma("unroll") for (int i = 0; i < CHAINS; ++i) {                                              \
    if ((USES) & A) r ^= a[i];                                                                      \
    if ((USES) & B) r ^= b[i];                                                                      \
    if ((USES) & C) r ^= c[i];                                                                      \
    if ((USES) & F) r ^= __float_as_uint(f[i]);                                                     \
    if ((USES) & W) r ^= uint32_t(w[i]) ^ uint32_t(w[i] >> 32);                                     \
  }                                                                                                 \
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;                                                   \
  __syncthreads();                                                                                  \
  if (threadIdx.x == 0) {                                                                           \
    uint32_t sm;                                                                                    \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));                                                 \
    stamps[3 * blockIdx.x] = sm;                                                                    \
    stamps[3 * blockIdx.x + 1] = t0;                                                                \
    stamps[3 * blockIdx.x + 2] = clock64();                                                         \
  }

// One kernel: `iters` iterations of kSteps / CHAINS rounds over CHAINS chains; BODY sees u (round) and i.
#define PF_KERNEL(NAME, CHAINS, USES, BODY)                                                              \
  extern "C" __global__ void __launch_bounds__(kThreads, 8)                                         \
      NAME(uint32_t* out, uint32_t seed, int iters, unsigned long long* stamps) {                   \
    PF_PROLOGUE(CHAINS)                                                                            \
    _Pragma("unroll 1") for (int it = 0; it < iters; ++it) {                                        \
      _Pragma("unroll") for (int u = 0; u < kSteps / (CHAINS); ++u) {                               \
        _Pragma("unroll") for (int i = 0; i < (CHAINS); ++i) { BODY; }                              \
      }                                                                                             \
    }                                                                                               \
    PF_EPILOGUE(CHAINS, USES)                                                                      \
  }

// The instructions, each on one chain variable x (PTX that ptxas turns into the SASS named).
#define LOP3(x) asm volatile("lop3.b32 %0, %0, %1, %2, 0x6A;" : "+r"(x) : "r"(k1), "r"(k2))       // LOP3.LUT
#define LOP3_IMM(x) asm volatile("lop3.b32 %0, %0, 0x8FFF8FFF, %1, 0x6A;" : "+r"(x) : "r"(k2))    // LOP3.LUT, imm
#define SHF_FUNNEL(x) asm volatile("shf.r.wrap.b32 %0, %0, %1, %2;" : "+r"(x) : "r"(k1), "r"(s1))  // SHF.R.W.U32
#define SHF_SHR(x) asm volatile("shr.u32 %0, %0, %1;" : "+r"(x) : "r"(s1))                        // SHF.R.U32.HI
// Selectors and second sources alternate by round so that no two PRMTs compose into one.
#define PRMT(x, u)                                                                                 \
  do {                                                                                              \
    if ((u) & 1) asm volatile("prmt.b32 %0, %0, %1, 0x3241;" : "+r"(x) : "r"(k2));                  \
    else asm volatile("prmt.b32 %0, %0, %1, 0x5410;" : "+r"(x) : "r"(k4));                          \
  } while (0)
#define IADD3(x, y) asm volatile("add.u32 %0, %0, %1;\n\tadd.u32 %0, %0, %2;" : "+r"(x) : "r"(y), "r"(k1))
#define IMAD(x) asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(k1), "r"(k2))             // IMAD
#define IMAD_K34(x) asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(k3), "r"(k4))         // IMAD, own operands
#define IMAD_IMM(x) asm volatile("mad.lo.u32 %0, %0, 0xCBAC1FED, %1;" : "+r"(x) : "r"(k2))           // IMAD, imm
#define IMAD_SHL(x) asm volatile("mul.lo.u32 %0, %0, 16;" : "+r"(x))                               // IMAD.SHL.U32
#define IMAD_HI(x) asm volatile("mul.hi.u32 %0, %0, %1;" : "+r"(x) : "r"(k1))                      // IMAD.HI.U32
#define IMAD_WIDE(x)                                                                               \
  asm volatile("{ .reg .u32 l, h; mov.b64 {l, h}, %0; mul.wide.u32 %0, h, %1; }" : "+l"(x) : "r"(k1))
#define SGXT(x, u) asm volatile("szext.wrap.s32 %0, %0, %1;" : "+r"(x) : "r"((u) & 1 ? n1 : n2))    // SGXT.W
#define SGXT_U(x, u) asm volatile("szext.wrap.u32 %0, %0, %1;" : "+r"(x) : "r"((u) & 1 ? n1 : n2))  // SGXT.W.U32
#define HFMA2(x) asm volatile("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(x) : "r"(k3), "r"(k4))          // HFMA2 (or HFMA2.MMA)
#define HADD2(x) asm volatile("add.rn.f16x2 %0, %0, %1;" : "+r"(x) : "r"(k3))                       // HADD2
// The decode's h0 + h1: one HADD2 whose operands select the low and the high half.
#define HADD2_HALVES(x)                                                                            \
  asm volatile("{ .reg .b16 l, h; .reg .b32 ll, hh; mov.b32 {l, h}, %0; mov.b32 ll, {l, l}; mov.b32 hh, {h, h};" \
               " add.rn.f16x2 %0, ll, hh; }" : "+r"(x))
#define I2F(x) asm volatile("{ .reg .f32 t; cvt.rn.f32.u32 t, %0; mov.b32 %0, t; }" : "+r"(x))      // I2FP.F32.U32
#define I2F_F16(x) asm volatile("{ .reg .b16 t; cvt.rn.f16.u32 t, %0; cvt.u32.u16 %0, t; }" : "+r"(x))  // I2F.F16.U32
#define FFMA(x) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x) : "f"(1.0001f), "f"(0.5f))      // FFMA

// Each instruction alone (8 chains), and beside as many LOP3s on chains of their own.
PF_KERNEL(pf_lop3, 8, A, LOP3(a[i]))
PF_KERNEL(pf_lop3_imm, 8, A, LOP3_IMM(a[i]))
PF_KERNEL(pf_shf_funnel, 8, A, SHF_FUNNEL(a[i]))
PF_KERNEL(pf_shf_shr, 8, A, SHF_SHR(a[i]))
PF_KERNEL(pf_prmt, 8, A, PRMT(a[i], u))
PF_KERNEL(pf_iadd3, 8, A, IADD3(a[i], a[(i + 1) % 8]))
PF_KERNEL(pf_imad, 8, A, IMAD(a[i]))
PF_KERNEL(pf_imad_imm, 8, A, IMAD_IMM(a[i]))
PF_KERNEL(pf_imad_shl_hi, 8, A, IMAD_SHL(a[i]); IMAD_HI(a[i]))  // a chain of shifts alone would fold
PF_KERNEL(pf_imad_hi, 8, A, IMAD_HI(a[i]))
PF_KERNEL(pf_imad_wide, 8, W, IMAD_WIDE(w[i]))
PF_KERNEL(pf_sgxt, 8, A, SGXT(a[i], u))
PF_KERNEL(pf_sgxt_u32, 8, A, SGXT_U(a[i], u))
PF_KERNEL(pf_hfma2, 8, A, HFMA2(a[i]))
PF_KERNEL(pf_hadd2, 8, A, HADD2(a[i]))
PF_KERNEL(pf_hadd2_halves, 8, A, HADD2_HALVES(a[i]))
PF_KERNEL(pf_i2f, 8, A, I2F(a[i]))
PF_KERNEL(pf_i2f_f16, 8, A, I2F_F16(a[i]))
PF_KERNEL(pf_ffma, 8, F, FFMA(f[i]))

PF_KERNEL(pf_lop3_imm__lop3, 8, A | B, LOP3_IMM(a[i]); LOP3(b[i]))
PF_KERNEL(pf_shf_funnel__lop3, 8, A | B, SHF_FUNNEL(a[i]); LOP3(b[i]))
PF_KERNEL(pf_shf_shr__lop3, 8, A | B, SHF_SHR(a[i]); LOP3(b[i]))
PF_KERNEL(pf_prmt__lop3, 8, A | B, PRMT(a[i], u); LOP3(b[i]))
PF_KERNEL(pf_iadd3__lop3, 8, A | B, IADD3(a[i], a[(i + 1) % 8]); LOP3(b[i]))
PF_KERNEL(pf_imad__lop3, 8, A | B, IMAD(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad_imm__lop3, 8, A | B, IMAD_IMM(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad_shl__lop3, 8, A, IMAD_SHL(a[i]); LOP3(a[i]))  // one chain through both (shifts alone fold)
PF_KERNEL(pf_imad_hi__lop3, 8, A | B, IMAD_HI(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad_wide__lop3, 4, B | W, IMAD_WIDE(w[i]); LOP3(b[i]))
PF_KERNEL(pf_sgxt__lop3, 8, A | B, SGXT(a[i], u); LOP3(b[i]))
PF_KERNEL(pf_hfma2__lop3, 8, A | B, HFMA2(a[i]); LOP3(b[i]))
PF_KERNEL(pf_hadd2__lop3, 8, A | B, HADD2(a[i]); LOP3(b[i]))
PF_KERNEL(pf_hadd2_halves__lop3, 8, A | B, HADD2_HALVES(a[i]); LOP3(b[i]))
PF_KERNEL(pf_i2f__lop3, 8, A | B, I2F(a[i]); LOP3(b[i]))
PF_KERNEL(pf_i2f_f16__lop3, 8, A | B, I2F_F16(a[i]); LOP3(b[i]))
PF_KERNEL(pf_ffma__lop3, 8, B | F, FFMA(f[i]); LOP3(b[i]))

// IMAD + LOP3 every other way: immediates, operand registers of their own, one chain through both, fewer
// chains, other ratios, fewer warps
// (the same body as pf_imad__lop3 under the names _w32, _w16, _w8: the host launches them with fewer blocks).
PF_KERNEL(pf_imad_imm__lop3_imm, 8, A | B, IMAD_IMM(a[i]); LOP3_IMM(b[i]))
PF_KERNEL(pf_imad_k34__lop3, 8, A | B, IMAD_K34(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad_lop3_chain, 8, A, IMAD(a[i]); LOP3(a[i]))
PF_KERNEL(pf_imad_lop3_chain1, 1, A, IMAD(a[i]); LOP3(a[i]))
PF_KERNEL(pf_imad__lop3_chains1, 1, A | B, IMAD(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad__lop3_chains2, 2, A | B, IMAD(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad__lop3_chains4, 4, A | B, IMAD(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad2__lop3, 8, A | B | C, IMAD(a[i]); IMAD(c[i]); LOP3(b[i]))
PF_KERNEL(pf_imad__lop3x2, 8, A | B | C, IMAD(a[i]); LOP3(b[i]); LOP3(c[i]))
PF_KERNEL(pf_imad__lop3_w32, 8, A | B, IMAD(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad__lop3_w16, 8, A | B, IMAD(a[i]); LOP3(b[i]))
PF_KERNEL(pf_imad__lop3_w8, 8, A | B, IMAD(a[i]); LOP3(b[i]))

// pipe_mix.cu's kernel as it is (its 4096 iterations of 8 chains, its operands), for the same counters.
template <bool LOP, bool MAD>
__device__ __forceinline__ void pipe_mix_body(uint32_t* out, uint32_t seed, unsigned long long* stamps) {
  const unsigned long long t0 = clock64();
  uint32_t a[8], h[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    a[i] = seed + threadIdx.x * 17 + i;
    h[i] = a[i] * 3u;
  }
  const uint32_t k1 = seed | 1u, k2 = seed ^ 0x55u;
  for (int it = 0; it < 4096; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (LOP) asm volatile("lop3.b32 %0, %0, %1, %2, 0x6A;" : "+r"(a[i]) : "r"(k1), "r"(k2));
      if (MAD) asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(h[i]) : "r"(k1), "r"(k2));
    }
  }
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) r ^= a[i] ^ h[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    stamps[3 * blockIdx.x] = sm;
    stamps[3 * blockIdx.x + 1] = t0;
    stamps[3 * blockIdx.x + 2] = clock64();
  }
}
#define PM_KERNEL(NAME, LOP, MAD)                                                                  \
  extern "C" __global__ void __launch_bounds__(kThreads) NAME(uint32_t* out, uint32_t seed, int,    \
                                                               unsigned long long* stamps) {        \
    pipe_mix_body<LOP, MAD>(out, seed, stamps);                                                     \
  }
PM_KERNEL(pf_pm_lop3, true, false)
PM_KERNEL(pf_pm_imad, false, true)
PM_KERNEL(pf_pm_lop3_imad, true, true)

using Kernel = void (*)(uint32_t*, uint32_t, int, unsigned long long*);
struct Case {
  const char* name;
  Kernel kernel;
  int per_iter;      // payload warp instructions per loop iteration and warp
  int warps;         // per SM
  int fixed_iters;   // 0: iterations from the budget
  int slow;          // the budget divided by this (slow pipes)
  const char* sass;  // SASS opcodes the loop must hold per iteration, OPCODE=COUNT (A|B: either)
};
#define PF(NAME, OPS, SASS) {#NAME, NAME, kSteps * (OPS), 64, 0, 1, SASS}
#define PF_W(NAME, OPS, WARPS, SASS) {#NAME, NAME, kSteps * (OPS), WARPS, 0, 1, SASS}
#define PF_SLOW(NAME, OPS, SLOW, SASS) {#NAME, NAME, kSteps * (OPS), 64, 0, SLOW, SASS}
#define PM(NAME, OPS, SASS) {#NAME, NAME, 8 * (OPS), 64, 4096, 1, SASS}
const Case kCases[] = {
    PF(pf_lop3, 1, "LOP3.LUT=64"),
    PF(pf_lop3_imm, 1, "LOP3.LUT=64"),
    PF(pf_shf_funnel, 1, "SHF.R.W.U32=64"),
    PF(pf_shf_shr, 1, "SHF.R.U32.HI=64"),
    PF(pf_prmt, 1, "PRMT=64"),
    PF(pf_iadd3, 1, "IADD3=64"),
    PF(pf_imad, 1, "IMAD=64"),
    PF(pf_imad_imm, 1, "IMAD=64"),
    PF(pf_imad_shl_hi, 2, "IMAD.SHL.U32|SHF.L.U32=64 IMAD.HI.U32=64"),
    PF(pf_imad_hi, 1, "IMAD.HI.U32=64"),
    PF(pf_imad_wide, 1, "IMAD.WIDE.U32=64"),
    PF(pf_sgxt, 1, "SGXT.W=64"),
    PF(pf_sgxt_u32, 1, "SGXT.W.U32=64"),
    PF(pf_hfma2, 1, "HFMA2|HFMA2.MMA=64"),
    PF(pf_hadd2, 1, "HADD2|HFMA2.MMA=64"),
    PF(pf_hadd2_halves, 1, "HADD2=64"),
    PF(pf_i2f, 1, "I2FP.F32.U32=64"),
    PF_SLOW(pf_i2f_f16, 1, 4, "I2F.F16.U32=64"),
    PF(pf_ffma, 1, "FFMA=64"),
    PF(pf_lop3_imm__lop3, 2, "LOP3.LUT=128"),
    PF(pf_shf_funnel__lop3, 2, "SHF.R.W.U32=64 LOP3.LUT=64"),
    PF(pf_shf_shr__lop3, 2, "SHF.R.U32.HI=64 LOP3.LUT=64"),
    PF(pf_prmt__lop3, 2, "PRMT=64 LOP3.LUT=64"),
    PF(pf_iadd3__lop3, 2, "IADD3=64 LOP3.LUT=64"),
    PF(pf_imad__lop3, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad_imm__lop3, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad_shl__lop3, 2, "IMAD.SHL.U32|SHF.L.U32=64 LOP3.LUT=64"),
    PF(pf_imad_hi__lop3, 2, "IMAD.HI.U32=64 LOP3.LUT=64"),
    PF(pf_imad_wide__lop3, 2, "IMAD.WIDE.U32=64 LOP3.LUT=64"),
    PF(pf_sgxt__lop3, 2, "SGXT.W=64 LOP3.LUT=64"),
    PF(pf_hfma2__lop3, 2, "HFMA2|HFMA2.MMA=64 LOP3.LUT=64"),
    PF(pf_hadd2__lop3, 2, "HADD2|HFMA2.MMA=64 LOP3.LUT=64"),
    PF(pf_hadd2_halves__lop3, 2, "HADD2=64 LOP3.LUT=64"),
    PF(pf_i2f__lop3, 2, "I2FP.F32.U32=64 LOP3.LUT=64"),
    PF_SLOW(pf_i2f_f16__lop3, 2, 4, "I2F.F16.U32=64 LOP3.LUT=64"),
    PF(pf_ffma__lop3, 2, "FFMA=64 LOP3.LUT=64"),
    PF(pf_imad_imm__lop3_imm, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad_k34__lop3, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad_lop3_chain, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad_lop3_chain1, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad__lop3_chains1, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad__lop3_chains2, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad__lop3_chains4, 2, "IMAD=64 LOP3.LUT=64"),
    PF(pf_imad2__lop3, 3, "IMAD=128 LOP3.LUT=64"),
    PF(pf_imad__lop3x2, 3, "IMAD=64 LOP3.LUT=128"),
    PF_W(pf_imad__lop3_w32, 2, 32, "IMAD=64 LOP3.LUT=64"),
    PF_W(pf_imad__lop3_w16, 2, 16, "IMAD=64 LOP3.LUT=64"),
    PF_W(pf_imad__lop3_w8, 2, 8, "IMAD=64 LOP3.LUT=64"),
    PM(pf_pm_lop3, 1, "LOP3.LUT"),
    PM(pf_pm_imad, 1, "IMAD"),
    PM(pf_pm_lop3_imad, 2, "IMAD LOP3.LUT"),
};
constexpr int kBudget = 65536;  // payload warp instructions per warp: about 1 ms at 2 per clock per SM

int iterations(const Case& c) { return c.fixed_iters ? c.fixed_iters : std::max(1, kBudget / c.slow / c.per_iter); }

struct Timing {
  float ms;
  double per_clock_sm, per_clock_attr, mhz;
  int warps;
};

// One timed launch: per SM, its blocks' payload over its own clock span (min start .. max end).
int time_case(const Case& c, uint32_t* out, unsigned long long* stamps, int sms, int clock_khz, Timing* t) {
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, c.kernel, kThreads, 0));
  per_sm = std::min(per_sm, c.warps / (kThreads / 32));
  const int blocks = sms * per_sm, iters = iterations(c);
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  c.kernel<<<blocks, kThreads>>>(out, 0x00A3C5u, iters, stamps);  // warm-up
  CHECK(cudaEventRecord(e0));
  c.kernel<<<blocks, kThreads>>>(out, 0x00A3C7u, iters, stamps);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  CHECK(cudaEventElapsedTime(&t->ms, e0, e1));
  std::vector<unsigned long long> h(3 * blocks);
  CHECK(cudaMemcpy(h.data(), stamps, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
  std::vector<unsigned long long> lo(sms, ~0ull), hi(sms, 0);
  std::vector<int> count(sms, 0);
  for (int b = 0; b < blocks; ++b) {
    const int sm = int(h[3 * b]);
    if (sm < 0 || sm >= sms) continue;
    lo[sm] = std::min(lo[sm], h[3 * b + 1]);
    hi[sm] = std::max(hi[sm], h[3 * b + 2]);
    ++count[sm];
  }
  const double per_warp = double(iters) * c.per_iter;
  double rate = 0, span = 0;
  int used = 0;
  for (int sm = 0; sm < sms; ++sm) {
    if (!count[sm] || hi[sm] <= lo[sm]) continue;
    rate += count[sm] * (kThreads / 32) * per_warp / double(hi[sm] - lo[sm]);
    span += double(hi[sm] - lo[sm]);
    ++used;
  }
  t->per_clock_sm = used ? rate / used : 0;
  t->mhz = used ? span / used / (t->ms * 1e3) : 0;
  t->per_clock_attr = double(blocks) * (kThreads / 32) * per_warp / (t->ms * 1e-3 * clock_khz * 1e3) / sms;
  t->warps = per_sm * (kThreads / 32);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 0;
}

int main(int argc, char** argv) {
  const bool list = argc > 1 && !strcmp(argv[1], "--list"), once = argc > 1 && !strcmp(argv[1], "--once");
  if (list) {  // no CUDA call: runs without a GPU
    printf("case\tpayload_per_warp\twarps_per_sm\tsass\n");
    for (const Case& c : kCases) printf("%s\t%.0f\t%d\t%s\n", c.name, double(iterations(c)) * c.per_iter, c.warps, c.sass);
    return 0;
  }
  int sms = 0, clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  uint32_t* out;
  unsigned long long* stamps;
  CHECK(cudaMalloc(&out, size_t(sms) * 8 * kThreads * sizeof(uint32_t)));
  CHECK(cudaMalloc(&stamps, size_t(sms) * 8 * 3 * sizeof(unsigned long long)));
  if (once) {  // one launch per case for ncu, by kernel name
    for (const Case& c : kCases) {
      const int blocks = sms * (c.warps / (kThreads / 32));
      c.kernel<<<blocks, kThreads>>>(out, 0x00A3C5u, iterations(c), stamps);
      CHECK(cudaDeviceSynchronize());
      printf("%s\n", c.name);
    }
    return 0;
  }
  printf("%d SMs, attribute clock %d MHz; warp instructions (payload) per clock per SM\n", sms, clock_khz / 1000);
  printf("%-26s %5s %9s %12s %12s %8s\n", "case", "warps", "ms", "per SM clk", "per attr clk", "SM MHz");
  for (const Case& c : kCases) {
    Timing t{};
    if (time_case(c, out, stamps, sms, clock_khz, &t)) return 1;
    printf("%-26s %5d %9.3f %12.3f %12.3f %8.0f\n", c.name, t.warps, t.ms, t.per_clock_sm, t.per_clock_attr, t.mhz);
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
