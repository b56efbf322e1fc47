// Shared by the CUDA sources: error helpers and the handshake channel layout.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "host_plan.h"  // PlanStatic

namespace ftjax {

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Control block of one CPU-branch channel, in mapped pinned memory. The GPU writes the request
// fields and submit_seq (in that order, with a system fence); the CPU coordinator writes y, then
// status and done_seq. Sequence numbers are GPU-written so that replayed command buffers work.
// kind: kTaskRequest (cpu_experts_submit: the task list is staged) or kPlanRequest (cpu_experts_publish:
// the router's output and what the plan reads of the state are staged, the host plans the tasks,
// host_plan.h; the plan's statics in `plan`, its task count and checksum back in plan_n / plan_sum).
enum RequestKind : int32_t { kTaskRequest = 0, kPlanRequest = 1 };
static_assert(kPlanStatics <= 16, "HandshakeCtrl::plan holds the plan statics");
struct alignas(64) HandshakeCtrl {
  volatile uint32_t submit_seq;
  volatile int32_t n_valid;
  volatile int32_t n_tokens;
  volatile int32_t x_bf16;
  volatile int32_t task_capacity;
  volatile int32_t kind;
  volatile int32_t top_k;          // kPlanRequest: the router's k
  volatile int32_t step;           // kPlanRequest: the state's step counter
  volatile int32_t below;          // kPlanRequest: slots whose last_use (rebased) is below the call's step
  volatile float fill_fraction;    // kPlanRequest
  int32_t pad0[6];
  volatile int32_t plan[16];       // kPlanRequest: PlanStatic values (host_plan.h)
  volatile uint32_t done_seq;  // own cache line: written by the CPU, polled by the GPU
  volatile int32_t status;     // 0 ok, 2 the CPU branch failed (message kept host-side)
  volatile int32_t plan_n;     // kPlanRequest: the host plan's task count (-1: it failed), before done_seq
  volatile uint32_t plan_sum;  // kPlanRequest: its checksum (host_plan.h task_checksum summed)
  int32_t pad1[12];
};

// The checked collect reads done_seq, status, plan_n and plan_sum with one 16-byte load.
static_assert(offsetof(HandshakeCtrl, done_seq) % 64 == 0 &&
                  offsetof(HandshakeCtrl, status) == offsetof(HandshakeCtrl, done_seq) + 4 &&
                  offsetof(HandshakeCtrl, plan_sum) == offsetof(HandshakeCtrl, done_seq) + 12,
              "HandshakeCtrl: the done line's layout");

// kPlanMismatch: the host plan's task list differs from the device plan's (collect's check; never expected).
enum HandshakeStatus : int32_t { kOk = 0, kTimeout = 1, kCpuError = 2, kPlanMismatch = 3 };

}  // namespace ftjax
