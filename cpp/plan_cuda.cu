// The fused plan on the CUDA platform: plan_core run by one thread block, one launch per layer call
// (XLA's jnp plan is a chain of ~20 small kernels: ~26 us per layer on the H200, session 8; this kernel
// 8-13 us in session 13, bound by the latency of its phases' global-memory round trips; 6.8 us without
// misses and 13.4 with lru-split's fills in session 22, its loads all in the first pass). The state is
// read and written on the device; nothing waits on the host (command-buffer compatible).
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
constexpr size_t kPlanMaxSmem = 200 * 1024;  // the scratch without copies: 10 E int32 at most, up to 5,120 experts (plan_fused.py)

// One thread block: `each` strides over the threads; reductions and the stable compaction go through
// warp votes and shuffles and a 32-entry shared array (`red`), every thread getting the result.
struct BlockTeam {
  long long* red;
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ void sync() const { __syncthreads(); }
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

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs a, bool ids_copy, bool lu_copy) {
  extern __shared__ int32_t smem[];
  __shared__ long long red[32];
  const int64_t R = a.tokens * a.top_k;
  plan_core(BlockTeam{red}, a, plan_scratch(smem, R, a.n_experts, a.fill_capacity, a.n_slots, a.last_use, a.owner_of,
                                                 ids_copy, lu_copy));
}

ffi::Error PlanCudaImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, FTJAX_PLAN_ATTR_PARAMS) {
  PlanArgs a;
  ffi::Error err = plan_ffi::bind(args, rets, FTJAX_PLAN_ATTR_VALUES, &a);
  if (err.failure()) return err;
  const int64_t R = a.tokens * a.top_k;
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
    plan_kernel<<<1, kPlanThreads, smem, stream>>>(a, ids_copy, lu_copy);
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
