// The fused plan on the CPU platform: plan_core run by one thread, synchronously (XLA's CPU thread); with
// the `team_threads` attribute (tests), by that many host threads in the GPU thread block's form
// (strided phases, barriers, per-thread partials, compactions chunk by chunk), so CI checks plan_core's
// barrier placement.
#define FTJAX_PLAN_FN
#include "plan_core.h"

#include <atomic>
#include <thread>
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
  void add_i32(int32_t* p, int32_t v) const { *p += v; }
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

// What a ThreadTeam's threads share: a sense-reversing barrier and one partial per thread.
struct TeamState {
  explicit TeamState(int n) : n(n), partial(n) {}
  const int n;
  std::atomic<int> arrived{0}, phase{0};
  std::vector<uint64_t> partial;
};

// Thread `tid` of n: the BlockTeam of plan_cuda.cu with threads for warps.
struct ThreadTeam {
  int tid;
  TeamState* st;
  void sync() const {
    const int ph = st->phase.load(std::memory_order_acquire);
    if (st->arrived.fetch_add(1, std::memory_order_acq_rel) == st->n - 1) {
      st->arrived.store(0, std::memory_order_relaxed);
      st->phase.fetch_add(1, std::memory_order_acq_rel);
    } else {
      while (st->phase.load(std::memory_order_acquire) == ph) std::this_thread::yield();
    }
  }
  void add_i32(int32_t* p, int32_t v) const { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
  template <class F>
  void each(int64_t n, F f) const {
    for (int64_t i = tid; i < n; i += st->n) f(i);
  }
  template <class Combine>
  uint64_t reduce(uint64_t mine, uint64_t init, Combine combine) const {
    st->partial[tid] = mine;
    sync();
    uint64_t total = init;
    for (int w = 0; w < st->n; ++w) total = combine(total, st->partial[w]);
    sync();
    return total;
  }
  template <class F>
  int64_t sum(int64_t n, F f) const {
    int64_t v = 0;
    each(n, [&](int64_t i) { v += f(i); });
    return static_cast<int64_t>(
        reduce(static_cast<uint64_t>(v), 0, [](uint64_t a, uint64_t b) { return a + b; }));
  }
  template <class F>
  uint64_t min_u64(int64_t n, F f) const {
    uint64_t v = ~uint64_t{0};
    each(n, [&](int64_t i) {
      const uint64_t x = f(i);
      v = x < v ? x : v;
    });
    return reduce(v, ~uint64_t{0}, [](uint64_t a, uint64_t b) { return b < a ? b : a; });
  }
  // Stable: chunk by chunk of n entries, entry c + tid's position is the passing entries before it.
  template <class P, class Emit>
  int64_t compact(int64_t n, P pred, Emit emit) const {
    int64_t base = 0;
    for (int64_t c = 0; c < n; c += st->n) {
      const int64_t i = c + tid;
      const bool p = i < n && pred(i);
      st->partial[tid] = p;
      sync();
      int64_t before = base, total = 0;
      for (int w = 0; w < st->n; ++w) {
        if (w < tid) before += static_cast<int64_t>(st->partial[w]);
        total += static_cast<int64_t>(st->partial[w]);
      }
      if (p) emit(before, i);
      sync();
      base += total;
    }
    return base;
  }
};

ffi::Error PlanCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, FTJAX_PLAN_ATTR_PARAMS) {
  PlanArgs a;
  ffi::Error err = plan_ffi::bind(args, rets, FTJAX_PLAN_ATTR_VALUES, &a);
  if (err.failure()) return err;
  const int64_t R = a.tokens * a.top_k;
  // One thread gains nothing from the copies the GPU makes, but CI then runs the code paths the GPU runs:
  // the per-route copies unless there are more routes than experts, the per-slot copies when the call can
  // fill on one thread (as on the GPU where they fit) and never on a team (the GPU's form for caches too
  // large for shared memory: last_use and owner_of read and written in place by a call that fills).
  const bool ids_copy = R <= a.n_experts, lu_copy = a.fill_capacity > 0 && team_threads <= 1;
  thread_local std::vector<int32_t> scratch;
  scratch.resize(static_cast<size_t>(plan_scratch_ints(R, a.n_experts, a.fill_capacity, a.n_slots, ids_copy, lu_copy)));
  const PlanScratch sc = plan_scratch(scratch.data(), R, a.n_experts, a.fill_capacity, a.n_slots,
                                      a.last_use, a.owner_of, ids_copy, lu_copy);
  if (team_threads <= 1) {
    plan_core(SerialTeam{}, a, sc);
    return ffi::Error::Success();
  }
  if (team_threads > 64) return ffi::Error::InvalidArgument("plan_layer: team_threads must be in [1, 64]");
  TeamState st(static_cast<int>(team_threads));
  std::vector<std::thread> threads;
  for (int i = 1; i < st.n; ++i) threads.emplace_back([&, i] { plan_core(ThreadTeam{i, &st}, a, sc); });
  plan_core(ThreadTeam{0, &st}, a, sc);
  for (auto& th : threads) th.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxPlanCpu, PlanCpuImpl, FTJAX_PLAN_ATTRS(ffi::Ffi::Bind()));

void* plan_cpu_handler() { return reinterpret_cast<void*>(FtjaxPlanCpu); }

}  // namespace ftjax
