// The fused plan on the CUDA platform: plan_core run by one thread block, one launch per layer call
// (XLA's jnp plan is a chain of ~20 small kernels: ~26 us per layer on the H200, session 8; this kernel
// 8-13 us, bound by the latency of its phases' global-memory round trips, session 13). The state is
// read and written on the device; nothing waits on the host (command-buffer compatible). With a channel
// (`channel` >= 0) the kernel also does the CPU branch's submit: it stages x into the channel's mapped
// staging as it starts, the CPU tasks as soon as they are decided (before the LRU victims, plan_core.h),
// then fences and publishes, so the CPU branch starts mid-plan instead of after the plan and a separate
// submit kernel (~14 + 7 us per layer on the H200, session 18).
#define FTJAX_PLAN_FN __device__
#include "plan_core.h"

#include <string>

#include "cuda_common.h"
#include "ffi_cuda.h"
#include "plan_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

constexpr int kPlanThreads = 512;  // 16 warps
constexpr size_t kPlanMaxSmem = 200 * 1024;  // the scratch without copies: 8 E int32 at most, up to 6,400 experts (plan_fused.py)

// A publishing call's submit: the channel's control block and x staging (ctrl null: no publishing).
struct PlanPublish {
  HandshakeCtrl* ctrl;
  const uint8_t* x;
  uint8_t* x_stage;
  int64_t x_bytes;
  int32_t n_tokens, x_bf16, capacity;
  int32_t* token;
};

// One thread block: `each` strides over the threads; reductions and the stable compaction go through
// warp votes and shuffles and a 32-entry shared array (`red`), every thread getting the result.

struct BlockTeam {
  long long* red;
  const PlanPublish* pub;
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ void sync() const { __syncthreads(); }
  __device__ void add_i32(int32_t* p, int32_t v) const { atomicAdd(p, v); }
  // Every thread's staged stores fenced, then thread 0 publishes the first n tasks (uniform: all threads).
  __device__ void publish(int64_t n) const {
    if (!pub->ctrl) return;
    __threadfence_system();
    __syncthreads();
    if (tid() == 0)
      handshake_publish(pub->ctrl, static_cast<int32_t>(n), pub->n_tokens, pub->x_bf16, pub->capacity, pub->token);
  }
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

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs a, bool ids_copy, bool lu_copy, PlanPublish pub) {
  extern __shared__ int32_t smem[];
  __shared__ long long red[32];
  if (pub.ctrl) {  // x into the staging first: the stores cross PCIe while the plan runs (fenced in publish)
    const bool vec = pub.x_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(pub.x) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(pub.x_stage) % 16 == 0;
    if (vec) {
      const int4* src = reinterpret_cast<const int4*>(pub.x);
      int4* dst = reinterpret_cast<int4*>(pub.x_stage);
      for (int64_t i = threadIdx.x; i < pub.x_bytes / 16; i += blockDim.x) dst[i] = src[i];
    } else {
      for (int64_t i = threadIdx.x; i < pub.x_bytes; i += blockDim.x) pub.x_stage[i] = pub.x[i];
    }
  }
  const int64_t R = a.tokens * a.top_k;
  plan_core(BlockTeam{red, &pub}, a, plan_scratch(smem, R, a.n_experts, a.fill_capacity, a.last_use, ids_copy, lu_copy));
}

// The largest x a publishing call stages (one block copies it, as the fused submit does).
constexpr int64_t kPublishMaxBytes = 128 << 10;

ffi::Error PlanCudaImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, FTJAX_PLAN_ATTR_PARAMS) {
  PlanArgs a;
  plan_ffi::SubmitIo sub;
  ffi::Error err = plan_ffi::bind(args, rets, FTJAX_PLAN_ATTR_VALUES, &a, &sub);
  if (err.failure()) return err;
  const int64_t R = a.tokens * a.top_k;
  PlanPublish pub{};
  if (channel >= 0) {
    ChannelStaging st;
    if (!channel_staging(channel, &st))
      return ffi::Error::InvalidArgument("plan_layer: channel " + std::to_string(channel) +
                                         " was not created (ftjax.host.cuda.create_channel)");
    if (sub.x_tokens > st.max_tokens || sub.x_hidden != st.hidden || R > st.max_tasks ||
        sub.x_bytes > kPublishMaxBytes)
      return ffi::Error::InvalidArgument(
          "plan_layer: x [" + std::to_string(sub.x_tokens) + ", " + std::to_string(sub.x_hidden) + "] with " +
          std::to_string(R) + " routes does not fit channel " + std::to_string(channel) + " (at most " +
          std::to_string(st.max_tokens) + " tokens of " + std::to_string(st.hidden) + ", " +
          std::to_string(st.max_tasks) + " tasks) or the publishing plan's " + std::to_string(kPublishMaxBytes) +
          " B of x: submit separately (cpu_experts_submit)");
    pub = PlanPublish{st.ctrl, static_cast<const uint8_t*>(sub.x), st.x, sub.x_bytes,
                      static_cast<int32_t>(sub.x_tokens), sub.x_bf16 ? 1 : 0, static_cast<int32_t>(R), sub.token};
    a.stage_token = st.token;
    a.stage_flat = st.flat;
    a.stage_weight = st.weight;
    a.stage_units = st.units;
  }
  // The router ids, then last_use, copied into shared memory where they fit (plan_core.h PlanScratch);
  // otherwise read in place.
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
    plan_kernel<<<1, kPlanThreads, smem, stream>>>(a, ids_copy, lu_copy, pub);
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
