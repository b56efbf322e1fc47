// The expert copy shared by the fill kernels (ffi_cuda.cu, background.cu): device code, nvcc only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ftjax {

constexpr int kFillThreads = 256;
constexpr int kFillUnroll = 4;  // 16-byte loads in flight per thread: hides PCIe read latency

// Copies expert `id` of the pool into cache slot `slot`, both banks, the rows split over `workers`
// threads of which this is `worker`.
__device__ __forceinline__ void copy_expert(int64_t id, int64_t slot, int64_t worker, int64_t workers,
                                            const uint4* __restrict__ src0, uint4* __restrict__ dst0, int64_t row0,
                                            const uint4* __restrict__ src1, uint4* __restrict__ dst1, int64_t row1) {
  const int64_t total = row0 + row1;  // the two banks' rows, in 16-byte units, back to back
  for (int64_t base = worker; base < total; base += kFillUnroll * workers) {
    uint4 v[kFillUnroll];
#pragma unroll
    for (int u = 0; u < kFillUnroll; ++u) {
      const int64_t i = base + u * workers;
      if (i < total) v[u] = i < row0 ? src0[id * row0 + i] : src1[id * row1 + (i - row0)];
    }
#pragma unroll
    for (int u = 0; u < kFillUnroll; ++u) {
      const int64_t i = base + u * workers;
      if (i < total) {
        if (i < row0) dst0[slot * row0 + i] = v[u];
        else dst1[slot * row1 + (i - row0)] = v[u];
      }
    }
  }
}

}  // namespace ftjax
