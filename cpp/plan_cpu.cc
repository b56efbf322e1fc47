// The fused plan on the CPU platform: plan_core run by one thread, synchronously (XLA's CPU thread).
#define FTJAX_PLAN_FN
#include "plan_core.h"

#include <vector>

#include "ffi_cpu.h"
#include "plan_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// The team of one: every phase a plain loop.
struct SerialTeam {
  void sync() const {}
  template <class F>
  void each(int64_t n, F f) const {
    for (int64_t i = 0; i < n; ++i) f(i);
  }
  template <class F>
  int64_t sum(int64_t n, F f) const {
    int64_t v = 0;
    for (int64_t i = 0; i < n; ++i) v += f(i);
    return v;
  }
  template <class F>
  uint64_t min_u64(int64_t n, F f) const {
    uint64_t v = ~uint64_t{0};
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t x = f(i);
      v = x < v ? x : v;
    }
    return v;
  }
  template <class P, class Emit>
  int64_t compact(int64_t n, P pred, Emit emit) const {
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i)
      if (pred(i)) emit(c++, i);
    return c;
  }
};

ffi::Error PlanCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, FTJAX_PLAN_ATTR_PARAMS) {
  PlanArgs a;
  ffi::Error err = plan_ffi::bind(args, rets, FTJAX_PLAN_ATTR_VALUES, &a);
  if (err.failure()) return err;
  const int64_t R = a.tokens * a.top_k;
  // One thread gains nothing from the copies the GPU makes, but CI then runs the code paths the GPU runs:
  // last_use copied when the call can fill (as there), the ids copied unless there are more routes than
  // experts (so both the copy and the in-place read run in the tests).
  const bool ids_copy = R <= a.n_experts, lu_copy = a.fill_capacity > 0;
  thread_local std::vector<int32_t> scratch;
  scratch.resize(static_cast<size_t>(plan_scratch_ints(R, a.n_experts, a.fill_capacity, a.n_slots, ids_copy, lu_copy)));
  plan_core(SerialTeam{}, a,
            plan_scratch(scratch.data(), R, a.n_experts, a.fill_capacity, a.last_use, ids_copy, lu_copy));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxPlanCpu, PlanCpuImpl, FTJAX_PLAN_ATTRS(ffi::Ffi::Bind()));

void* plan_cpu_handler() { return reinterpret_cast<void*>(FtjaxPlanCpu); }

}  // namespace ftjax
