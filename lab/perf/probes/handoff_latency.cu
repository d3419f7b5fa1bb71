// What one global round trip costs where the fused call's phases hand data to each other
// (on H200: a batch of 8 loads per lane of data just written about 460 ns, 1 us from DRAM; 3 dependent
// loads about 290 ns).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o handoff_latency lab/perf/probes/handoff_latency.cu && ./handoff_latency
//
// A writer kernel (every SM) stores a small block of floats; a reader kernel of one warp, launched after it
// (with programmatic dependent launch, or plainly), times with clock64 from its wait's return:
//   batch  - 8 independent 16-byte loads per lane of what the writer stored (the activation's partial sums)
//   chain  - 3 dependent 4-byte loads (a lookup chain: ids -> combined id -> descriptor)
// for data the writer just stored, for the same data read again (in L2), and after 512 MB streamed past
// (DRAM), with and without that stream running beside the reader.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "../../../kernels/launch.cuh"
#include "check.cuh"

constexpr int kFloats = 8 * 8 * 1024;  // 8 planes of 8 K floats (256 KB)

__global__ void writer(float* buf, int* chain, uint32_t seed) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kFloats; i += gridDim.x * blockDim.x)
    buf[i] = float((i * 2654435761u + seed) & 0xFFFF);
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < 3) chain[threadIdx.x * 4096] = (threadIdx.x + 1) * 4096;
  asm volatile("griddepcontrol.launch_dependents;");
}

__global__ void streamer(const float4* big, size_t n, float* sink) {
  float4 acc = make_float4(0, 0, 0, 0);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float4 v = big[i];  // plain loads: they evict what the writer left in L2
    acc.x += v.x;
    acc.y += v.y;
  }
  if (acc.x == 1234.5f) sink[0] = acc.y;
  asm volatile("griddepcontrol.launch_dependents;");
}

__global__ void reader(const float* buf, const int* chain, long long* out, int wait) {
  if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
  const int lane = threadIdx.x;
  const long long t0 = clock64();
  float4 v[8];
#pragma unroll
  for (int p = 0; p < 8; ++p) v[p] = __ldcg(reinterpret_cast<const float4*>(buf + p * 8192) + lane * 2);
  float s = 0.f;
#pragma unroll
  for (int p = 0; p < 8; ++p) s += v[p].x + v[p].y + v[p].z + v[p].w;
  const long long t1 = clock64();
  int j = __ldcg(chain);
  j = __ldcg(chain + j);
  j = __ldcg(chain + j);
  const long long t2 = clock64();
  if (lane == 0) {
    out[0] = t1 - t0;
    out[1] = t2 - t1;
    out[2] = int(s) + j;
  }
}

int main() {
  float *buf, *sink;
  int* chain;
  float4* big;
  long long* out;
  const size_t big_n = (512u << 20) / 16;
  CHECK(cudaMalloc(&buf, kFloats * 4));
  CHECK(cudaMalloc(&chain, 3 * 4096 * 4 + 4));
  CHECK(cudaMalloc(&big, big_n * 16));
  CHECK(cudaMalloc(&sink, 16));
  CHECK(cudaMalloc(&out, 3 * 8));
  CHECK(cudaMemset(big, 0, big_n * 16));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  cudaStream_t stream, side;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  auto launch_reader = [&](bool pdl) {
    return trellis::launch(reader, dim3(1), dim3(32), 0, stream, pdl, buf, chain, out, pdl ? 1 : 0);
  };
  const char* names[] = {"fresh, PDL wait", "fresh, plain launch", "again (L2)", "after 512 MB (DRAM)",
                         "fresh, 512 MB streaming beside"};
  printf("SM clock %.0f MHz (attribute); cycles and ns at that clock, median of 21\n", clock_khz / 1e3);
  for (int c = 0; c < 5; ++c) {
    long long batch[21], chained[21];
    for (int rep = 0; rep < 21; ++rep) {
      if (c == 3) {
        writer<<<132, 256, 0, stream>>>(buf, chain, rep);
        streamer<<<528, 256, 0, stream>>>(big, big_n, sink);
      } else if (c == 4) {
        streamer<<<264, 256, 0, side>>>(big, big_n, sink);  // on another stream, beside the reader
        writer<<<132, 256, 0, stream>>>(buf, chain, rep);
      } else {
        writer<<<132, 256, 0, stream>>>(buf, chain, rep);
      }
      if (c == 2) CHECK(launch_reader(false));
      CHECK(launch_reader(c == 0 || c == 4));
      CHECK(cudaStreamSynchronize(stream));
      CHECK(cudaStreamSynchronize(side));
      long long host[3];
      CHECK(cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost));
      batch[rep] = host[0];
      chained[rep] = host[1];
    }
    auto median = [](long long* v) {
      for (int i = 0; i < 21; ++i)
        for (int j = i + 1; j < 21; ++j)
          if (v[j] < v[i]) {
            long long t = v[i];
            v[i] = v[j];
            v[j] = t;
          }
      return v[10];
    };
    const long long b = median(batch), ch = median(chained);
    printf("%-32s batch of 8 loads %6lld cycles (%5.0f ns)   chain of 3 loads %6lld cycles (%5.0f ns)\n", names[c], b,
           b * 1e6 / clock_khz, ch, ch * 1e6 / clock_khz);
  }
  return 0;
}
