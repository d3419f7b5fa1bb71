// What the host reads of a device to shape launches, read once and cached: shared by the library's host
// unit (trellis_moe.cu) and its GEMM units (gemm_unit.cu). Inline functions with external linkage, so
// every unit of one library shares one cache.
#pragma once
#include <cuda_runtime.h>

namespace trellis {

// What even_wave_smem needs of a device, read once per device: it runs on every call's host path.
struct SmLimits {
  int sms = 0, threads = 0, smem = 0, reserved = 0, optin = 0;
};
inline bool sm_limits(SmLimits& out) {
  constexpr int kDevices = 64;
  static SmLimits cache[kDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) return false;
  SmLimits& l = cache[device];
  if (l.sms == 0) {
    SmLimits read;
    if (cudaDeviceGetAttribute(&read.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.threads, cudaDevAttrMaxThreadsPerMultiProcessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&read.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        read.sms <= 0)
      return false;
    l = read;
  }
  out = l;
  return true;
}

// CTAs of `kernel` that fit on one SM with `smem` bytes of dynamic shared memory (0 when the query fails),
// per device. Cached: even_wave_smem and fc1_pieces ask on every call's host path.
template <typename Kernel>
int ctas_per_sm(Kernel kernel, int threads, int smem) {
  struct Entry {
    const void* kernel;
    int device, threads, smem, per_sm;
  };
  constexpr int kEntries = 64;
  static Entry cache[kEntries];
  static int used = 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const void* key = reinterpret_cast<const void*>(kernel);
  for (int i = 0; i < used; ++i)
    if (cache[i].kernel == key && cache[i].device == device && cache[i].threads == threads && cache[i].smem == smem)
      return cache[i].per_sm;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) return 0;
  if (used < kEntries) {  // not locked: a racing call at worst queries again
    cache[used] = {key, device, threads, smem, per_sm};
    ++used;
  }
  return per_sm;
}

}  // namespace trellis
