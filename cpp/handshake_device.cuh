// The CPU-branch handshake's device side shared by its CUDA sources (handshake.cu: submit / collect;
// host_plan_cuda.cu: the host plan's publish and checked collect), and a channel's staging as they see it.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda_common.h"
#include "ffi_cuda.h"
#include "fill_device.cuh"

namespace ftjax {

constexpr int kFusedThreads = 512;
constexpr int kCollectThreads = 256;  // fused collect: up to 16 blocks, one float4 per thread each
constexpr uint32_t kSkipped = 0;      // submit token of an empty task list

// A channel's mapped staging (device pointers) and its offsets: x, the task arrays (a plan request's ids, slots,
// gate weights, recency), a plan request's slot last_use and token mask, y.
struct ChannelView {
  HandshakeCtrl* ctrl_dev;
  uint8_t* stage_dev;
  size_t x_off, tok_off, eid_off, w_off, u_off, lu_off, valid_off, y_off;
  int64_t hidden, max_tokens, max_tasks;
};
bool channel_view(int64_t channel, ChannelView* out);  // false: no such channel

// A channel's stamps (handshake.cu): the GPU's row per fused submit and per fused collect, in call order
// (`counts` [2] on the device: submits, collects; `ring` [kStampRing, kStFields] in mapped memory). In the
// default path the two counts advance together, so a call's submit and collect share a row (the seqs tell).
struct StampsDev {
  uint64_t* counts;
  int64_t* ring;
};
// The next row of one counter (0: submit, 1: collect); one thread.
__device__ inline int64_t* stamp_row(const StampsDev& s, int which) {
  const uint64_t i = s.counts[which]++;
  return s.ring + static_cast<int64_t>(i % kStampRing) * kStFields;
}

// Poll done_seq until it reaches the token's sequence number (the CPU's status) or timeout_ns passes
// (kTimeout): the watchdog that turns a stuck CPU branch into a status, never a hang.
__device__ inline int32_t wait_done(const HandshakeCtrl* ctrl, const int32_t* token, uint64_t timeout_ns) {
  const uint32_t seq = static_cast<uint32_t>(*token);
  if (seq == kSkipped) return kOk;
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    if (static_cast<int32_t>(ctrl->done_seq - seq) >= 0) return ctrl->status;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) return kTimeout;
    __nanosleep(100);
  }
}

// The CPU branch leaves the transfer words (`words`, nullptr: not counted) once its collect saw it end
// (or gave up on it).
__device__ inline void cpu_branch_left(const int32_t* token, int32_t* words) {
  if (words && static_cast<uint32_t>(*token) != kSkipped) atomicSub(words + kWordCpu, 1);
}

// A request in two halves, for a block that stages data: thread 0 writes the fields (and reads the channel's
// last sequence number, a PCIe round trip) before the block's system fence, so that one fence orders the
// staged data and the fields before the seq, the read overlapping it; after the barrier thread 0 publishes.
__device__ inline uint32_t request_fields(HandshakeCtrl* ctrl, int32_t kind, int32_t n_valid, int32_t n_tokens,
                                          int32_t x_bf16, int32_t capacity) {
  uint32_t seq = ctrl->submit_seq + 1;
  if (seq == kSkipped) seq = 1;
  ctrl->kind = kind;
  ctrl->n_valid = n_valid;
  ctrl->n_tokens = n_tokens;
  ctrl->x_bf16 = x_bf16;
  ctrl->task_capacity = capacity;
  return seq;
}

// The seq (after a system fence that follows the fields and the staged data), the token, the in-flight count.
__device__ inline void request_publish(HandshakeCtrl* ctrl, uint32_t seq, int32_t* token, int32_t* words) {
  ctrl->submit_seq = seq;
  *token = static_cast<int32_t>(seq);
  if (words) atomicAdd(words + kWordCpu, 1);  // in flight until its collect
}

// The request (its fields and the staged data written before) under the next sequence number.
__device__ inline void publish_now(HandshakeCtrl* ctrl, int32_t kind, int32_t n_valid, int32_t n_tokens, int32_t x_bf16,
                                   int32_t capacity, int32_t* token, int32_t* words, bool trailing_fence = true) {
  const uint32_t seq = request_fields(ctrl, kind, n_valid, n_tokens, x_bf16, capacity);
  __threadfence_system();  // the request fields (and the staged data) precede the seq
  request_publish(ctrl, seq, token, words);
  if (trailing_fence) __threadfence_system();
}

}  // namespace ftjax
