// The fused plan on the CPU platform: plan_core run by one thread, synchronously (XLA's CPU thread); with
// the `team_threads` attribute (tests), by that many host threads in the GPU thread block's form
// (strided phases, barriers, per-thread partials, compactions chunk by chunk), so CI checks plan_core's
// barrier placement.
#define FTJAX_PLAN_FN
#include "plan_core.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ffi_cpu.h"
#include "host_plan.h"
#include "plan_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// The team of one: every phase a plain loop.
struct SerialTeam {
  void sync() const {}
  void publish(int64_t) const {}  // (the CPU platform has no channel: staging is the check form only)
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
  void publish(int64_t) const {}
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
  plan_ffi::PublishOperands pub;
  ffi::Error err = plan_ffi::bind(args, rets, FTJAX_PLAN_ATTR_VALUES, &a, &pub);
  if (err.failure()) return err;
  if (publish == plan_ffi::kPublishChannel)
    return ffi::Error::InvalidArgument("plan_layer: publishing to a CPU-branch channel is the CUDA platform's");
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

void host_plan_tasks(const HostPlanStatics& st, const HostPlanInputs& in, HostPlanTasks* out) {
  const int64_t T = st.tokens, k = st.top_k, R = T * k, E = st.n_experts, F = st.fill_capacity;
  if (T < 1 || k < 1 || E < 1 || F < 0 || F > (R < E ? R : E) || st.layer < 0)
    throw std::invalid_argument("host plan: bad call shape (T=" + std::to_string(T) + ", k=" + std::to_string(k) +
                                ", E=" + std::to_string(E) + ", F=" + std::to_string(F) + ")");
  if (st.rule < kRuleBalance || st.rule > kRuleNone) throw std::invalid_argument("host plan: unknown rule");
  if (st.split_inter < 0 || (st.split_inter > 0 && (st.split_granule < 1 || st.split_inter % st.split_granule)))
    throw std::invalid_argument("host plan: unit split: the granule must divide I");
  // The rebase of the LRU clock (plan_core: layer 0 of a call past rebase_at) applied to what was gathered.
  const int32_t shift = (st.layer == 0 && st.update && in.step >= st.rebase_at) ? st.rebase_by : 0;
  const auto back = [&](int32_t v) { return v >= 0 ? std::max(v - shift, 0) : v; };
  const int32_t step = in.step - shift + 1;

  // The stand-in state of one layer: the routed experts that hit get slots 0.. (in order of first route),
  // then min(evictable, F) evictable slots, then held ones up to F more slots in all.
  thread_local std::vector<int32_t> slot_of, recency, owner_of, last_use, hist, outs, task_i, scratch;
  thread_local std::vector<float> task_w;
  slot_of.assign(E, -1);
  recency.assign(E, 0);
  thread_local std::vector<char> seen;
  seen.assign(E, 0);
  int32_t hits = 0;
  int64_t hit_below = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (!in.valid[r / k]) continue;
    const int32_t id = in.ids[r];
    if (id < 0 || id >= E)
      throw std::invalid_argument("host plan: route " + std::to_string(r) + " has router id " + std::to_string(id) +
                                  " outside [0, " + std::to_string(E) + ")");
    if (seen[id]) continue;
    seen[id] = 1;
    recency[id] = back(in.recency[r]);
    if (in.slot[r] >= 0) {
      slot_of[id] = hits++;
      if (back(in.slot_lu[r]) < step) ++hit_below;  // (the plan stamps a hit's slot with the step first)
    }
  }
  const int64_t evictable = std::clamp<int64_t>(static_cast<int64_t>(in.below) - hit_below, 0, F);
  const int64_t S = std::max<int64_t>(1, hits + F);
  owner_of.assign(S, -1);
  last_use.assign(S, INT32_MAX);
  for (int64_t e = 0; e < E; ++e)
    if (slot_of[e] >= 0) {
      owner_of[slot_of[e]] = static_cast<int32_t>(e);
      last_use[slot_of[e]] = 0;
    }
  for (int64_t j = 0; j < evictable; ++j) last_use[hits + j] = 0;
  hist.assign(E + kPlanStats, 0);
  int32_t fake_step = in.step - shift;

  // The plan's outputs: route_slot, cpu_routes, route_units, cpu_units [R], fill_ids, fill_slots [F], 7
  // scalars, task_token, task_flat [R] (task_weight apart).
  outs.assign(4 * R + 2 * F + 7, 0);
  task_i.assign(2 * R, 0);
  task_w.assign(R, 0.f);
  PlanArgs a{};
  a.ids = in.ids;
  a.token_valid = in.valid;
  a.fill_fraction = &in.fill_fraction;
  a.slot_of = slot_of.data();
  a.owner_of = owner_of.data();
  a.last_use = last_use.data();
  a.step = &fake_step;
  a.recency = recency.data();
  for (int i = 0; i < kPlanStats; ++i) a.stats[i] = &hist[E + i];
  a.hist = hist.data();
  int32_t* o = outs.data();
  a.route_slot = o;
  a.cpu_routes = o + R;
  a.route_units = o + 2 * R;
  a.cpu_units = o + 3 * R;
  a.fill_ids = o + 4 * R;
  a.fill_slots = o + 4 * R + F;
  int32_t* sc = o + 4 * R + 2 * F;
  a.n_cpu_routes = sc;
  a.n_fill = sc + 1;
  a.hits = sc + 2;
  a.misses = sc + 3;
  a.cpu_experts = sc + 4;
  a.deferred = sc + 5;
  a.fill_units = sc + 6;
  a.gate_weights = in.gate;
  a.task_token = task_i.data();
  a.task_flat = task_i.data() + R;
  a.task_weight = task_w.data();
  a.bg_ids = a.bg_slots = a.bg_n = a.bg_from = nullptr;
  a.bg_cols = 0;
  a.tokens = T;
  a.top_k = k;
  a.n_experts = E;
  a.layer = 0;
  a.n_ids = E;
  a.n_slots = S;
  a.fill_capacity = F;
  a.rule = st.rule;
  a.update = st.update;
  a.defer_horizon = st.defer_horizon;
  a.split_inter = st.split_inter;
  a.split_granule = st.split_granule;
  a.rebase_at = INT32_MAX;  // (rebased above)
  a.rebase_by = 0;
  a.all_units = st.all_units;
  const bool ids_copy = R <= E, lu_copy = F > 0;
  scratch.resize(static_cast<size_t>(plan_scratch_ints(R, E, F, S, ids_copy, lu_copy)));
  plan_core(SerialTeam{}, a, plan_scratch(scratch.data(), R, E, F, S, a.last_use, a.owner_of, ids_copy, lu_copy));

  const int64_t n = *a.n_cpu_routes, base = st.layer * E;
  out->n = n;
  out->token.assign(a.task_token, a.task_token + n);
  out->flat.resize(n);
  out->units.assign(a.cpu_units, a.cpu_units + n);
  out->weight.assign(a.task_weight, a.task_weight + n);
  uint32_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    out->flat[j] = static_cast<int32_t>(base + a.task_flat[j]);
    uint32_t wb;
    std::memcpy(&wb, &out->weight[j], 4);
    sum += task_checksum(out->token[j], out->flat[j], out->units[j], wb);
  }
  out->checksum = sum;
}

}  // namespace ftjax
