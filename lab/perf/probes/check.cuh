// The probes' error check: print where a CUDA call failed and leave main with 1.
#pragma once
#include <cuda_runtime.h>
#include <stdio.h>

#define CHECK(x)                                                         \
  do {                                                                   \
    cudaError_t e = (x);                                                 \
    if (e != cudaSuccess) {                                              \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));   \
      return 1;                                                          \
    }                                                                    \
  } while (0)
