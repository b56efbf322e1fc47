// The host plan's CUDA calls (cpp/host_plan.h): cpu_experts_publish stages, before the GPU's plan kernel, what
// the coordinator needs to plan the CPU branch's tasks itself (x, the router's ids and gate weights, the token
// mask, each route's expert slot and recency and the slot's last_use, the count of slots below the call's step)
// and publishes a kPlanRequest; cpu_experts_collect_checked waits for it, compares the host's task count and
// checksum with the device plan's task arrays (a mismatch fails the call: status kPlanMismatch, y NaN) and
// copies y back. The coordinator's side is in handshake.cu (Coordinator::serve).
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "cuda_common.h"
#include "ffi_cuda.h"
#include "handshake_device.cuh"
#include "host_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {
// cpu_experts_publish: one block stages x, the router's ids and gate weights, the token mask and, per route,
// its expert's slot and recency and the slot's last_use; counts the slots whose last_use (rebased as the plan
// will rebase it) is below the call's step; then publishes a kPlanRequest with the plan's statics.
struct PublishPlanArgs {
  HandshakeCtrl* ctrl;
  uint8_t* stage;
  int64_t x_off, ids_off, slot_off, gate_off, rec_off, lu_off, valid_off;
  const uint8_t* x;
  int64_t x_bytes;
  const int32_t* ids;
  const float* gate;
  const int32_t* valid;
  const float* fill_fraction;
  const int32_t* slot_of;
  const int32_t* recency;
  const int32_t* last_use;
  const int32_t* step;
  int64_t tokens, top_k, n_ids, n_slots;
  int32_t statics[kPlanStatics];
  int32_t x_bf16;
  int32_t* token;
  int32_t* words;
};

__global__ void publish_plan_kernel(PublishPlanArgs a) {
  // Every load first (the scan's eight per thread, the router's outputs, then the two dependent gathers),
  // then the stores to the mapped staging, one system fence per thread, and thread 0's request: its fields,
  // one more fence, the sequence number (no trailing fence: the request is on its way).
  __shared__ int32_t red[32];
  const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
  const int64_t E = a.statics[kPsExperts], base = a.statics[kPsLayer] * E, R = a.tokens * a.top_k, S = a.n_slots;
  const int32_t step0 = *a.step;
  const bool rebase = a.statics[kPsLayer] == 0 && a.statics[kPsUpdate] && step0 >= a.statics[kPsRebaseAt];
  const int32_t shift = rebase ? a.statics[kPsRebaseBy] : 0, step = step0 - shift + 1;
  int32_t below = 0;
  if (a.statics[kPsFillCapacity] > 0)  // the evictable count's first part (plan_core: last_use < step, rebased)
    for (int64_t c = tid; c * 8 < S; c += nthreads) {
      int32_t v[8];
      for (int q = 0; q < 8; ++q) v[q] = c * 8 + q < S ? a.last_use[c * 8 + q] : 0;
      for (int q = 0; q < 8; ++q) {
        const int32_t b = v[q] >= 0 ? max(v[q] - shift, 0) : v[q];
        below += c * 8 + q < S && b < step;
      }
    }
  const int64_t n16 = a.x_bytes / 16;  // (x and the staging are 16-byte aligned: checked by the host)
  const int4* xs = reinterpret_cast<const int4*>(a.x);
  int4* xd = reinterpret_cast<int4*>(a.stage + a.x_off);
  for (int64_t i = tid; i < n16; i += nthreads) xd[i] = xs[i];
  for (int64_t i = 16 * n16 + tid; i < a.x_bytes; i += nthreads) a.stage[a.x_off + i] = a.x[i];
  int32_t* ids_d = reinterpret_cast<int32_t*>(a.stage + a.ids_off);
  int32_t* slot_d = reinterpret_cast<int32_t*>(a.stage + a.slot_off);
  float* gate_d = reinterpret_cast<float*>(a.stage + a.gate_off);
  int32_t* rec_d = reinterpret_cast<int32_t*>(a.stage + a.rec_off);
  int32_t* lu_d = reinterpret_cast<int32_t*>(a.stage + a.lu_off);
  int32_t* valid_d = reinterpret_cast<int32_t*>(a.stage + a.valid_off);
  for (int64_t r = tid; r < R; r += nthreads) {
    const int32_t id = a.ids[r];
    const float g = a.gate[r];
    const bool in = id >= 0 && id < E && base + id < a.n_ids;
    const int32_t slot = in ? a.slot_of[base + id] : -1, rec = in ? a.recency[base + id] : 0;
    const int32_t lu = (slot >= 0 && slot < S) ? a.last_use[slot] : 0;
    ids_d[r] = id;
    gate_d[r] = g;
    slot_d[r] = slot;
    rec_d[r] = rec;
    lu_d[r] = lu;
  }
  for (int64_t t = tid; t < a.tokens; t += nthreads) valid_d[t] = a.valid[t];
  for (int o = 16; o; o >>= 1) below += __shfl_down_sync(0xffffffffu, below, o);
  if ((tid & 31) == 0) red[tid >> 5] = below;
  __threadfence_system();  // this thread's staging stores before the request (thread 0's, after the barrier)
  __syncthreads();
  if (tid == 0) {
    int32_t total = 0;
    for (int w = 0; w < nthreads / 32; ++w) total += red[w];
    HandshakeCtrl* ctrl = a.ctrl;
    ctrl->top_k = static_cast<int32_t>(a.top_k);
    ctrl->step = step0;
    ctrl->below = total;
    ctrl->fill_fraction = *a.fill_fraction;
    for (int i = 0; i < kPlanStatics; ++i) ctrl->plan[i] = a.statics[i];
    publish_now(ctrl, kPlanRequest, static_cast<int32_t>(R), static_cast<int32_t>(a.tokens), a.x_bf16,
                static_cast<int32_t>(R), a.token, a.words, /*trailing_fence=*/false);
  }
}

// The checked collect of a published call: every block's first warp waits (lane 0), sums the device plan's
// task checksum and compares it and the task count with the host plan's (a mismatch fails the call), then
// the block copies its share of y back (zeros without reading the staging when the host had no task).
__global__ void collect_checked_kernel(const HandshakeCtrl* ctrl, const int32_t* token, uint64_t timeout_ns,
                                       const float* y_stage, float* __restrict__ y, int64_t n, bool vec,
                                       int32_t* status, int32_t* words, const int32_t* n_dev,
                                       const int32_t* task_token, const int32_t* task_flat, const float* task_weight,
                                       const int32_t* task_units, int64_t capacity) {
  __shared__ int32_t st, host_n;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    int32_t s = kOk, hn = 0;
    uint32_t hs = 0;
    if (lane == 0) {
      // done_seq, status, plan_n and plan_sum in one 16-byte read per poll (one PCIe round trip: the host
      // writes the other three before done_seq, in one cache line)
      const void* line = const_cast<const uint32_t*>(&ctrl->done_seq);
      const uint32_t seq = static_cast<uint32_t>(*token);
      uint64_t start, now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
      for (;;) {
        uint32_t done, status, n, sum;
        asm volatile("ld.volatile.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(done), "=r"(status), "=r"(n), "=r"(sum)
                     : "l"(line)
                     : "memory");
        if (static_cast<int32_t>(done - seq) >= 0) {
          s = static_cast<int32_t>(status);
          hn = static_cast<int32_t>(n);
          hs = sum;
          break;
        }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) {
          s = kTimeout;
          break;
        }
        __nanosleep(100);
      }
      __threadfence_system();  // y was written before done_seq: read it only after seeing done_seq
    }
    s = __shfl_sync(0xffffffffu, s, 0);
    hn = __shfl_sync(0xffffffffu, hn, 0);
    hs = __shfl_sync(0xffffffffu, hs, 0);
    const int32_t nd = static_cast<int32_t>(min(static_cast<int64_t>(max(*n_dev, 0)), capacity));
    uint32_t sum = 0;
    for (int32_t j = lane; j < nd; j += 32)
      sum += task_checksum(task_token[j], task_flat[j], task_units[j], __float_as_uint(task_weight[j]));
    for (int o = 16; o; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if (lane == 0) {
      if (s == kOk && (hn != *n_dev || hs != sum)) s = kPlanMismatch;
      st = s;
      host_n = hn;
      if (blockIdx.x == 0) {
        *status = s;
        cpu_branch_left(token, words);
      }
    }
  }
  __syncthreads();
  const bool ok = st == kOk, zero = ok && host_n == 0;
  const float fill = ok ? 0.f : NAN;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n4 = vec ? n / 4 : 0;
  for (int64_t i = first; i < n4; i += stride)
    reinterpret_cast<float4*>(y)[i] = ok && !zero ? __ldcv(reinterpret_cast<const float4*>(y_stage) + i)
                                                  : make_float4(fill, fill, fill, fill);
  for (int64_t i = 4 * n4 + first; i < n; i += stride) y[i] = ok && !zero ? __ldcv(y_stage + i) : fill;
}


ffi::Error PublishImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> gate,
                       ffi::Buffer<ffi::S32> valid, ffi::Buffer<ffi::F32> fill_fraction, ffi::Buffer<ffi::S32> slot_of,
                       ffi::Buffer<ffi::S32> recency, ffi::Buffer<ffi::S32> last_use, ffi::Buffer<ffi::S32> step,
                       ffi::Result<ffi::Buffer<ffi::S32>> token, ffi::Result<ffi::Buffer<ffi::S32>>,
                       ffi::Result<ffi::Buffer<ffi::S32>>, ffi::Result<ffi::Buffer<ffi::S32>>,
                       ffi::Result<ffi::Buffer<ffi::S32>>, int64_t channel, int64_t layer, int64_t n_experts,
                       int64_t fill_capacity, int64_t rule, int64_t update, int64_t defer_horizon, int64_t split_inter,
                       int64_t split_granule, int64_t rebase_at, int64_t rebase_by, int64_t all_units) {
  const std::string tag = "cpu_experts_publish: ";
  ChannelView view;
  if (!channel_view(channel, &view))
    return ffi::Error::InvalidArgument(tag + "channel " + std::to_string(channel) + " was not created");
  const ChannelView* ch = &view;
  const auto xd = x.dimensions(), id = ids.dimensions();
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (xd.size() != 2 || xd[1] != ch->hidden || xd[0] > ch->max_tokens ||
      (!bf16 && x.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument(tag + "x must be f32/bf16 [T <= " + std::to_string(ch->max_tokens) + ", " +
                                       std::to_string(ch->hidden) + "]");
  const int64_t T = xd[0];
  if (id.size() != 2 || id[0] != T || id[1] < 1 || T * id[1] > ch->max_tasks ||
      static_cast<int64_t>(gate.element_count()) != T * id[1] || static_cast<int64_t>(valid.element_count()) != T)
    return ffi::Error::InvalidArgument(tag + "ids and gate weights must be [T, k] (T * k <= " +
                                       std::to_string(ch->max_tasks) + "), token_valid [T]");
  const int64_t N = static_cast<int64_t>(slot_of.element_count()), S = static_cast<int64_t>(last_use.element_count());
  if (fill_fraction.element_count() != 1 || step.element_count() != 1 ||
      static_cast<int64_t>(recency.element_count()) != N || n_experts < 1 || layer < 0 || (layer + 1) * n_experts > N)
    return ffi::Error::InvalidArgument(tag + "the cache state does not match layer " + std::to_string(layer) + " x " +
                                       std::to_string(n_experts) + " experts");
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!aligned(x.untyped_data()))
    return ffi::Error::InvalidArgument(tag + "x must be 16-byte aligned");
  PublishPlanArgs a;
  a.ctrl = ch->ctrl_dev;
  a.stage = ch->stage_dev;
  a.x_off = static_cast<int64_t>(ch->x_off);
  a.ids_off = static_cast<int64_t>(ch->tok_off);
  a.slot_off = static_cast<int64_t>(ch->eid_off);
  a.gate_off = static_cast<int64_t>(ch->w_off);
  a.rec_off = static_cast<int64_t>(ch->u_off);
  a.lu_off = static_cast<int64_t>(ch->lu_off);
  a.valid_off = static_cast<int64_t>(ch->valid_off);
  a.x = static_cast<const uint8_t*>(x.untyped_data());
  a.x_bytes = static_cast<int64_t>(x.size_bytes());
  a.ids = ids.typed_data();
  a.gate = gate.typed_data();
  a.valid = valid.typed_data();
  a.fill_fraction = fill_fraction.typed_data();
  a.slot_of = slot_of.typed_data();
  a.recency = recency.typed_data();
  a.last_use = last_use.typed_data();
  a.step = step.typed_data();
  a.tokens = T;
  a.top_k = id[1];
  a.n_ids = N;
  a.n_slots = S;
  const int64_t statics[kPlanStatics] = {n_experts, layer, fill_capacity, rule, update, defer_horizon, split_inter,
                                         split_granule, rebase_at, rebase_by, all_units};
  for (int i = 0; i < kPlanStatics; ++i) {
    if (statics[i] < INT32_MIN || statics[i] > INT32_MAX)
      return ffi::Error::InvalidArgument(tag + "plan attribute " + std::to_string(i) + " out of int32 range");
    a.statics[i] = static_cast<int32_t>(statics[i]);
  }
  a.x_bf16 = bf16 ? 1 : 0;
  a.token = token->typed_data();
  a.words = transfer_words(false);
  publish_plan_kernel<<<1, kFusedThreads, 0, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(tag + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error CollectCheckedImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> n_dev,
                              ffi::Buffer<ffi::S32> task_token, ffi::Buffer<ffi::S32> task_flat,
                              ffi::Buffer<ffi::F32> task_weight, ffi::Buffer<ffi::S32> task_units,
                              ffi::Result<ffi::Buffer<ffi::F32>> y, ffi::Result<ffi::Buffer<ffi::S32>> status,
                              int64_t channel, int64_t timeout_ms) {
  const std::string tag = "cpu_experts_collect_checked: ";
  ChannelView view;
  if (!channel_view(channel, &view))
    return ffi::Error::InvalidArgument(tag + "channel " + std::to_string(channel) + " was not created");
  const ChannelView* ch = &view;
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[1] != ch->hidden || yd[0] > ch->max_tokens)
    return ffi::Error::InvalidArgument(tag + "y must be [T <= max_tokens, hidden]");
  if (timeout_ms <= 0) return ffi::Error::InvalidArgument(tag + "timeout_ms must be > 0");
  const int64_t cap = static_cast<int64_t>(task_token.element_count());
  if (n_dev.element_count() != 1 || static_cast<int64_t>(task_flat.element_count()) != cap ||
      static_cast<int64_t>(task_weight.element_count()) != cap ||
      static_cast<int64_t>(task_units.element_count()) != cap)
    return ffi::Error::InvalidArgument(tag + "the device plan's task arrays must have one length");
  const int64_t n = static_cast<int64_t>(y->element_count());
  const bool vec = reinterpret_cast<uintptr_t>(y->untyped_data()) % 16 == 0;
  const int blocks = static_cast<int>(std::clamp<int64_t>((n / 4 + kCollectThreads - 1) / kCollectThreads, 1, 16));
  collect_checked_kernel<<<blocks, kCollectThreads, 0, stream>>>(
      ch->ctrl_dev, token.typed_data(), static_cast<uint64_t>(timeout_ms) * 1000000ull,
      reinterpret_cast<const float*>(ch->stage_dev + ch->y_off), y->typed_data(), n, vec, status->typed_data(),
      transfer_words(false), n_dev.typed_data(), task_token.typed_data(), task_flat.typed_data(),
      task_weight.typed_data(), task_units.typed_data(), cap);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(tag + cudaGetErrorString(err));
  return ffi::Error::Success();
}

#define FTJAX_PUBLISH_BINDING                                                                       \
  ffi::Ffi::Bind()                                                                                  \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                                                     \
      .Arg<ffi::AnyBuffer>()                                                                        \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Attr<int64_t>("channel")                                                                     \
      .Attr<int64_t>("layer")                                                                       \
      .Attr<int64_t>("n_experts")                                                                   \
      .Attr<int64_t>("fill_capacity")                                                               \
      .Attr<int64_t>("rule")                                                                        \
      .Attr<int64_t>("update")                                                                      \
      .Attr<int64_t>("defer_horizon")                                                               \
      .Attr<int64_t>("split_inter")                                                                 \
      .Attr<int64_t>("split_granule")                                                               \
      .Attr<int64_t>("rebase_at")                                                                   \
      .Attr<int64_t>("rebase_by")                                                                   \
      .Attr<int64_t>("all_units")
#define FTJAX_COLLECT_CHECKED_BINDING                                                               \
  ffi::Ffi::Bind()                                                                                  \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                                                     \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::F32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Attr<int64_t>("channel")                                                                     \
      .Attr<int64_t>("timeout_ms")
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuPublish, PublishImpl, FTJAX_PUBLISH_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuCollectChecked, CollectCheckedImpl, FTJAX_COLLECT_CHECKED_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

void* cpu_publish_handler() { return reinterpret_cast<void*>(FtjaxCpuPublish); }
void* cpu_collect_checked_handler() { return reinterpret_cast<void*>(FtjaxCpuCollectChecked); }

}  // namespace ftjax
