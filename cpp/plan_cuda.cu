// The fused plan on the CUDA platform: plan_core run by one thread block, one launch per layer call
// (XLA's jnp plan is a chain of ~20 small kernels: ~26 us per layer on the H200, session 8; this kernel
// 8-13 us in session 13, bound by the latency of its phases' global-memory round trips; 6.8 us without
// misses and 13.4 with lru-split's fills in session 22, its loads all in the first pass). The state is
// read and written on the device; nothing waits on the host (command-buffer compatible).
// publish=kPublishChannel: the kernel also stages x and the CPU branch's task list in a channel's mapped
// staging and publishes the request (cpu_experts_submit's kTaskRequest) as soon as the list is known, before
// the victims: the CPU call starts from inside the plan kernel and no submit kernel runs.
#define FTJAX_PLAN_FN __device__
#include "plan_core.h"

#include <string>

#include "cuda_common.h"
#include "ffi_cuda.h"
#include "handshake_device.cuh"
#include "plan_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

constexpr int kPlanThreads = 512;  // 16 warps
constexpr size_t kPlanMaxSmem = 200 * 1024;  // the scratch without copies: 10 E int32 at most, up to 5,120 experts (plan_fused.py)

// One thread block: `each` strides over the threads; reductions and the stable compaction go through
// warp votes and shuffles and a 32-entry shared array (`red`), every thread getting the result.
struct BlockTeam {
  long long* red;
  HandshakeCtrl* ctrl;  // the channel's request (nullptr: the plan publishes nothing)
  int32_t* token;       // the submit token (cpu_experts_collect's)
  int32_t* words;
  int32_t n_tokens, x_bf16, capacity;
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ void sync() const { __syncthreads(); }
  // The staged x and tasks (every thread's stores) and the request's fields (thread 0, its read of the last
  // seq overlapping the fence) before the seq: one system fence; an empty list is not published (kSkipped:
  // collect writes zeros without waiting). n is the same in every thread.
  __device__ void publish(int64_t n) const {
    if (!ctrl) return;
    if (n <= 0) {
      if (tid() == 0) *token = static_cast<int32_t>(kSkipped);
      return;
    }
    uint32_t seq = 0;
    if (tid() == 0) seq = request_fields(ctrl, kTaskRequest, static_cast<int32_t>(n), n_tokens, x_bf16, capacity);
    __threadfence_system();
    __syncthreads();
    if (tid() == 0) request_publish(ctrl, seq, token, words);
  }
  __device__ void add_i32(int32_t* p, int32_t v) const { atomicAdd(p, v); }
  template <class F>
  __device__ void each(int64_t n, F f) const {
    for (int64_t i = tid(); i < n; i += blockDim.x) f(i);
  }
  template <class F>
  __device__ int64_t sum(int64_t n, F f) const {
    long long v = 0;
    each(n, [&](int64_t i) { v += f(i); });
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((tid() & 31) == 0) red[tid() >> 5] = v;
    __syncthreads();
    long long total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += red[w];
    __syncthreads();
    return total;
  }
  template <class F>
  __device__ uint64_t min_u64(int64_t n, F f) const {
    unsigned long long v = ~0ull;
    each(n, [&](int64_t i) {
      const unsigned long long x = f(i);
      v = x < v ? x : v;
    });
    for (int o = 16; o; o >>= 1) {
      const unsigned long long x = __shfl_down_sync(0xffffffffu, v, o);
      v = x < v ? x : v;
    }
    if ((tid() & 31) == 0) red[tid() >> 5] = static_cast<long long>(v);
    __syncthreads();
    unsigned long long best = ~0ull;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      const unsigned long long x = static_cast<unsigned long long>(red[w]);
      best = x < best ? x : best;
    }
    __syncthreads();
    return best;
  }
  // Stable: entry i's position is the number of earlier entries that pass, chunk by chunk of the block.
  template <class P, class Emit>
  __device__ int64_t compact(int64_t n, P pred, Emit emit) const {
    const int lane = tid() & 31, warp = tid() >> 5, warps = static_cast<int>(blockDim.x >> 5);
    int64_t base = 0;
    for (int64_t c = 0; c < n; c += blockDim.x) {
      const int64_t i = c + tid();
      const bool p = i < n && pred(i);
      const unsigned vote = __ballot_sync(0xffffffffu, p);
      if (lane == 0) red[warp] = __popc(vote);
      __syncthreads();
      int64_t before = base, total = 0;
      for (int w = 0; w < warps; ++w) {
        if (w < warp) before += red[w];
        total += red[w];
      }
      if (p) emit(before + __popc(vote & ((1u << lane) - 1u)), i);
      __syncthreads();
      base += total;
    }
    return base;
  }
};

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs a, BlockTeam team, bool ids_copy, bool lu_copy) {
  extern __shared__ int32_t smem[];
  __shared__ long long red[32];
  const int64_t R = a.tokens * a.top_k;
  team.red = red;
  plan_core(team, a, plan_scratch(smem, R, a.n_experts, a.fill_capacity, a.n_slots, a.last_use, a.owner_of,
                                                 ids_copy, lu_copy));
}

ffi::Error PlanCudaImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, FTJAX_PLAN_ATTR_PARAMS) {
  PlanArgs a;
  plan_ffi::PublishOperands pub;
  ffi::Error err = plan_ffi::bind(args, rets, FTJAX_PLAN_ATTR_VALUES, &a, &pub);
  if (err.failure()) return err;
  const int64_t R = a.tokens * a.top_k;
  BlockTeam team{nullptr, nullptr, nullptr, nullptr, 0, 0, 0};
  if (publish == plan_ffi::kPublishChannel) {
    ChannelView ch;
    if (!channel_view(channel, &ch))
      return ffi::Error::InvalidArgument("plan_layer: channel " + std::to_string(channel) +
                                         " was not created (ftjax.host.cuda.create_channel)");
    if (pub.hidden != ch.hidden || pub.tokens > ch.max_tokens || R > ch.max_tasks)
      return ffi::Error::InvalidArgument("plan_layer: x [" + std::to_string(pub.tokens) + ", " +
                                         std::to_string(pub.hidden) + "] and " + std::to_string(R) +
                                         " routes do not fit channel " + std::to_string(channel) + " ([<= " +
                                         std::to_string(ch.max_tokens) + ", " + std::to_string(ch.hidden) +
                                         "], <= " + std::to_string(ch.max_tasks) + " tasks)");
    a.x_words = static_cast<const uint32_t*>(pub.x);
    a.x_word_count = pub.x_bytes / 4;
    a.stage_x = reinterpret_cast<uint32_t*>(ch.stage_dev + ch.x_off);
    a.stage_token = reinterpret_cast<int32_t*>(ch.stage_dev + ch.tok_off);
    a.stage_flat = reinterpret_cast<int32_t*>(ch.stage_dev + ch.eid_off);
    a.stage_weight = reinterpret_cast<float*>(ch.stage_dev + ch.w_off);
    a.stage_units = reinterpret_cast<int32_t*>(ch.stage_dev + ch.u_off);
    team = BlockTeam{nullptr, ch.ctrl_dev, pub.token, transfer_words(false), static_cast<int32_t>(pub.tokens),
                     pub.x_bf16 ? 1 : 0, static_cast<int32_t>(R)};
  }
  // The per-route copies, then the per-slot ones (last_use, owner_of), in shared memory where they fit
  // (plan_core.h PlanScratch); otherwise read in place.
  const auto bytes = [&](bool ids, bool lu) {
    return sizeof(int32_t) * plan_scratch_ints(R, a.n_experts, a.fill_capacity, a.n_slots, ids, lu);
  };
  const bool ids_copy = bytes(true, false) <= kPlanMaxSmem;
  const bool lu_copy = a.fill_capacity > 0 && bytes(ids_copy, true) <= kPlanMaxSmem;
  const size_t smem = bytes(ids_copy, lu_copy);
  if (smem > kPlanMaxSmem)
    return ffi::Error::InvalidArgument("plan_layer: " + std::to_string(n_experts) + " experts need " +
                                       std::to_string(smem) + " B of shared memory, more than the fused plan's " +
                                       std::to_string(kPlanMaxSmem) + " (use plan_impl=\"scatter\")");
  cudaError_t e = cudaSuccess;
  if (smem > 48 * 1024)  // above the default limit of dynamic shared memory: opt in (every Hopper has 227 KiB)
    e = cudaFuncSetAttribute(plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e == cudaSuccess) {
    plan_kernel<<<1, kPlanThreads, smem, stream>>>(a, team, ids_copy, lu_copy);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("plan_layer launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxPlanCuda, PlanCudaImpl,
                              FTJAX_PLAN_ATTRS(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

void* plan_cuda_handler() { return reinterpret_cast<void*>(FtjaxPlanCuda); }

}  // namespace ftjax
