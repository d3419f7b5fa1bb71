// How many CTAs of FC1's launch shape the GPU runs at once in thread block clusters of 1 to 8
// (on H200: 264 CTAs without clusters, 224-248 in clusters of 3 to 8, so M=1's 256 FC1 CTAs in clusters
// of 8 need two waves).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o cluster_occupancy lab/perf/probes/cluster_occupancy.cu && ./cluster_occupancy
//
// The shape is that of FC1's 16-row K3/K4 kernel: 512 threads, 2 CTAs per SM, 99,840 bytes of shared memory
// (expert_gemm.cuh fc1_smem_bytes). A cluster starts only where one GPC has room for all of its CTAs at
// once, so where a GPC's free slots are not a multiple of the cluster size some stay empty. The probe also
// launches one grid of as many clusters of 8 as were reported and counts the CTAs each SM received.
#include <cuda_runtime.h>
#include <stdio.h>

#include "check.cuh"

constexpr int kThreads = 512, kSmem = 99840, kMaxSms = 1024;

// Records each CTA's SM, then holds it long enough that the whole grid is resident together.
__global__ void __launch_bounds__(kThreads, 2) where(int* sm_of_cta) {
  extern __shared__ int scratch[];
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
  scratch[threadIdx.x] = sm;
  if (threadIdx.x == 0) sm_of_cta[blockIdx.x] = scratch[0];
  const long long start = clock64();
  while (clock64() - start < 2000000) {
  }
}

cudaLaunchConfig_t clusters_of(int size, int ctas, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmem;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = size;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

int main() {
  CHECK(cudaFuncSetAttribute(where, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  int sms = 0, per_sm = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, where, kThreads, kSmem));
  printf("%d SMs x %d CTAs = %d CTAs without clusters\n", sms, per_sm, sms * per_sm);
  int clusters_of_8 = 0;
  for (int size = 1; size <= 8; ++size) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = clusters_of(size, size, &attribute);
    int clusters = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&clusters, where, &config));
    printf("clusters of %d: %3d at once = %3d CTAs\n", size, clusters, clusters * size);
    if (size == 8) clusters_of_8 = clusters;
  }
  int* d_sm = nullptr;
  CHECK(cudaMalloc(&d_sm, kMaxSms * 8 * sizeof(int)));
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = clusters_of(8, clusters_of_8 * 8, &attribute);
  CHECK(cudaLaunchKernelEx(&config, where, d_sm));
  CHECK(cudaDeviceSynchronize());
  static int sm_of_cta[kMaxSms * 8], per[kMaxSms];
  CHECK(cudaMemcpy(sm_of_cta, d_sm, clusters_of_8 * 8 * sizeof(int), cudaMemcpyDeviceToHost));
  for (int i = 0; i < clusters_of_8 * 8; ++i) per[sm_of_cta[i] % kMaxSms]++;
  int held[3] = {0, 0, 0};
  for (int s = 0; s < sms; ++s) held[per[s] < 2 ? per[s] : 2]++;
  printf("%d clusters of 8 at once: SMs holding 0 / 1 / 2 CTAs: %d / %d / %d\n", clusters_of_8, held[0], held[1], held[2]);
  return 0;
}
