// Shared by the CUDA sources: error helpers and the handshake channel layout.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ftjax {

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Control block of one CPU-branch channel, in mapped pinned memory. The GPU writes the request
// fields and submit_seq (in that order, with a system fence); the CPU coordinator writes y, then
// status and done_seq. Sequence numbers are GPU-written so that replayed command buffers work.
struct alignas(64) HandshakeCtrl {
  volatile uint32_t submit_seq;
  volatile int32_t n_valid;
  volatile int32_t n_tokens;
  volatile int32_t x_bf16;
  volatile int32_t task_capacity;
  int32_t pad0[11];
  volatile uint32_t done_seq;  // own cache line: written by the CPU, polled by the GPU
  volatile int32_t status;     // 0 ok, 2 the CPU branch failed (message kept host-side)
  int32_t pad1[14];
};

enum HandshakeStatus : int32_t { kOk = 0, kTimeout = 1, kCpuError = 2 };

}  // namespace ftjax
