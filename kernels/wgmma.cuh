// Hopper warpgroup MMA (wgmma, sm_90a): the primitives the large-tile GEMM (expert_wgmma.cuh) needs.
//
// One wgmma.m64nNk16 multiplies a 64x16 fp16 A held in the registers of the warpgroup's 4 warps (warp w:
// rows 16w..16w+15, the mma.m16n8k16 A fragment layout) by a 16xN fp16 B that the tensor cores read
// from shared memory through a descriptor, into N/2 fp32 accumulators per thread (per n8 block i, the
// mma.m16n8k16 C fragment: d[4i..4i+3] = (g, 8i+2t), (g, 8i+2t+1), (g+8, 8i+2t), (g+8, 8i+2t+1)).
// It runs asynchronously: the issuing warps go on decoding while it multiplies.
#pragma once
#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TRELLIS_DEVICE_WGMMA 1
#endif

namespace trellis {

// B in shared memory in the 128-byte swizzled "K-major" layout (each n row holds its k values contiguously,
// 64 halves = 128 bytes per row and atom, 16-byte pieces XOR-permuted by row % 8 within each 8-row group,
// groups `group_bytes` apart; atoms 1024-byte aligned). A k16 step inside an atom starts 32 bytes further.
__device__ __forceinline__ uint64_t swizzled_descriptor(uint32_t address, uint32_t group_bytes) {
  return uint64_t((address & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(group_bytes >> 4) << 32) |
         (uint64_t(1) << 62);
}

// The descriptor of `address + offset_bytes` from that of `address`: a 32-bit add on the start address
// field (bits 0-13, 16-byte units), which never carries out since shared memory ends below 256 KB. Rebuilding
// the descriptor per MMA cost 3-4 more uniform instructions each.
__device__ __forceinline__ uint64_t descriptor_plus(uint64_t desc, uint32_t offset_bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(desc) + (offset_bytes >> 4));
}

#ifdef TRELLIS_DEVICE_WGMMA
// Orders the warpgroup's register writes (the decoded A) before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// wgmma reads shared memory through the async proxy: the thread's own writes (plain stores, completed
// cp.async copies) become visible to it after this fence and a barrier.
__device__ __forceinline__ void wgmma_fence_shared_writes() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Waits until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// d += A * B for N = 16, 32, 48, 64, 80, 96, 112 or 128 routes (d[0 .. N/2 - 1]; the rest untouched). The
// accumulators stay bound to their registers from one wgmma to the next (same shape).
template <int N>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[64], const uint32_t a[4], uint64_t b_desc);

// One specialization per N, from its accumulator operands (16 at a time) and the numbers of the operands
// after them (A fragment, B descriptor, scale-d predicate): the operand list then matches the shape exactly.
#define TRELLIS_ACC16(i)                                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),  \
      "+f"(d[i + 7]), "+f"(d[i + 8]), "+f"(d[i + 9]), "+f"(d[i + 10]), "+f"(d[i + 11]), "+f"(d[i + 12]),       \
      "+f"(d[i + 13]), "+f"(d[i + 14]), "+f"(d[i + 15])
#define TRELLIS_ACC8(i)                                                                                         \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),  \
      "+f"(d[i + 7])
#define TRELLIS_ACC_NAMES_0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define TRELLIS_ACC_NAMES_16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define TRELLIS_ACC_NAMES_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define TRELLIS_ACC_NAMES_48 ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define TRELLIS_ACC_NAMES8_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define TRELLIS_ACC_NAMES8_16 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define TRELLIS_ACC_NAMES8_32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define TRELLIS_ACC_NAMES8_48 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define TRELLIS_WGMMA_RS(N, NAMES, A0, A1, A2, A3, DESC, PRED, ...)                                            \
  template <>                                                                                                \
  __device__ __forceinline__ void wgmma_m64nNk16<N>(float(&d)[64], const uint32_t a[4], uint64_t b_desc) {   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PRED ", 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" NAMES "}, {%" #A0 ", %" #A1      \
                 ", %" #A2 ", %" #A3 "}, %" #DESC ", p, 1, 1, 0;\n}\n"                                         \
                 : __VA_ARGS__                                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));                          \
  }

TRELLIS_WGMMA_RS(16, TRELLIS_ACC_NAMES8_0, 8, 9, 10, 11, 12, 13, TRELLIS_ACC8(0))
TRELLIS_WGMMA_RS(32, TRELLIS_ACC_NAMES_0, 16, 17, 18, 19, 20, 21, TRELLIS_ACC16(0))
TRELLIS_WGMMA_RS(48, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES8_16, 24, 25, 26, 27, 28, 29, TRELLIS_ACC16(0),
                 TRELLIS_ACC8(16))
TRELLIS_WGMMA_RS(64, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16, 32, 33, 34, 35, 36, 37, TRELLIS_ACC16(0),
                 TRELLIS_ACC16(16))
TRELLIS_WGMMA_RS(80, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16 TRELLIS_ACC_NAMES8_32, 40, 41, 42, 43, 44, 45,
                 TRELLIS_ACC16(0), TRELLIS_ACC16(16), TRELLIS_ACC8(32))
TRELLIS_WGMMA_RS(96, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16 TRELLIS_ACC_NAMES_32, 48, 49, 50, 51, 52, 53,
                 TRELLIS_ACC16(0), TRELLIS_ACC16(16), TRELLIS_ACC16(32))
TRELLIS_WGMMA_RS(112, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16 TRELLIS_ACC_NAMES_32 TRELLIS_ACC_NAMES8_48, 56, 57,
                 58, 59, 60, 61, TRELLIS_ACC16(0), TRELLIS_ACC16(16), TRELLIS_ACC16(32), TRELLIS_ACC8(48))
TRELLIS_WGMMA_RS(128, TRELLIS_ACC_NAMES_0 TRELLIS_ACC_NAMES_16 TRELLIS_ACC_NAMES_32 TRELLIS_ACC_NAMES_48, 64, 65, 66,
                 67, 68, 69, TRELLIS_ACC16(0), TRELLIS_ACC16(16), TRELLIS_ACC16(32), TRELLIS_ACC16(48))
#undef TRELLIS_WGMMA_RS

// Pins the accumulators after the last wait: the compiler must not read them before the MMAs finish.
__device__ __forceinline__ void wgmma_fence_accumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

}  // namespace trellis
