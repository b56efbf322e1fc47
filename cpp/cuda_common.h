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
constexpr uint32_t kSkipped = 0;  // submit token of an empty task list (real sequence numbers skip it)

#ifdef __CUDACC__
// The request's publication, by one GPU thread once the staged data is fenced: n_valid and the shape,
// a system fence, submit_seq + 1; `token` gets the sequence number (kSkipped, nothing published, when
// the task list is empty). Shared by the submit kernels and the plan kernel that publishes.
__device__ inline void handshake_publish(HandshakeCtrl* ctrl, int32_t n_valid, int32_t n_tokens, int32_t x_bf16,
                                         int32_t capacity, int32_t* token) {
  if (n_valid <= 0) {  // nothing for the CPU: no request, collect returns zeros at once
    *token = static_cast<int32_t>(kSkipped);
    return;
  }
  uint32_t seq = ctrl->submit_seq + 1;
  if (seq == kSkipped) seq = 1;
  ctrl->n_valid = n_valid;
  ctrl->n_tokens = n_tokens;
  ctrl->x_bf16 = x_bf16;
  ctrl->task_capacity = capacity;
  __threadfence_system();  // the request fields (and the staged data) precede the seq
  ctrl->submit_seq = seq;
  __threadfence_system();
  *token = static_cast<int32_t>(seq);
}
#endif

}  // namespace ftjax
