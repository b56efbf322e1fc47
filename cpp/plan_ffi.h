// The FFI face of the fused plan (plan_core.h), shared by the CPU and the CUDA handlers: the operand
// and result order (ftjax/experts/plan_fused.py builds the call) and the checks. The cache state is
// read and written through the results (aliased to their operands).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "plan_core.h"  // (the includer defines FTJAX_PLAN_FN first)
#include "xla/ffi/api/ffi.h"

namespace ftjax {

namespace plan_ffi {
namespace ffi = xla::ffi;

// Operands: ids [T, k], token_valid [T] (i32), fill_fraction [] (f32), then the state (aliased to
// results 0..11): slot_of, owner_of, last_use, step, recency, six [L] counters, hist.
constexpr int kStateArgs = 3, kStateCount = 12, kArgs = kStateArgs + kStateCount;
// Results: the state, then route_slot, cpu_routes, route_units, cpu_units [R], fill_ids, fill_slots [F],
// n_cpu_routes, n_fill, hits, misses, cpu_experts, deferred, fill_units [].
constexpr int kRets = kStateCount + 13;

inline std::string tag(const char* what) { return std::string("plan_layer: ") + what; }

// An operand's data and shape (ffi::Buffer has no empty state to assign into).
struct Operand {
  void* data = nullptr;
  int64_t count = 0;
  std::vector<int64_t> dims;
};

template <ffi::DataType D>
inline ffi::Error get_arg(const ffi::RemainingArgs& args, int i, Operand* out) {
  auto r = args.get<ffi::Buffer<D>>(i);
  if (!r.has_value())
    return ffi::Error::InvalidArgument(tag("operand ") + std::to_string(i) +
                                       (D == ffi::F32 ? " must be float32" : " must be int32"));
  out->data = r->untyped_data();
  out->count = static_cast<int64_t>(r->element_count());
  out->dims.assign(r->dimensions().begin(), r->dimensions().end());
  return ffi::Error::Success();
}

inline ffi::Error ret_i32(const ffi::RemainingRets& rets, int i, int64_t n, int32_t** out) {
  auto r = rets.get<ffi::Buffer<ffi::S32>>(i);
  if (!r.has_value()) return ffi::Error::InvalidArgument(tag("result ") + std::to_string(i) + " must be int32");
  if (static_cast<int64_t>((*r)->element_count()) != n)
    return ffi::Error::InvalidArgument(tag("result ") + std::to_string(i) + " has " +
                                       std::to_string((*r)->element_count()) + " elements, expected " +
                                       std::to_string(n));
  *out = (*r)->typed_data();
  return ffi::Error::Success();
}

#define FTJAX_PLAN_TRY(expr)        \
  do {                              \
    ffi::Error e_ = (expr);         \
    if (e_.failure()) return e_;    \
  } while (0)

// Fills `a` (pointers of XLA's buffers: device pointers for the CUDA handler) and checks every shape.
inline ffi::Error bind(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, int64_t layer,
                       int64_t n_experts, int64_t fill_capacity, int64_t rule, int64_t update,
                       int64_t defer_horizon, int64_t split_inter, int64_t split_granule, int64_t rebase_at,
                       int64_t rebase_by, int64_t all_units, PlanArgs* a) {
  if (static_cast<int>(args.size()) != kArgs || static_cast<int>(rets.size()) != kRets)
    return ffi::Error::InvalidArgument(tag("expected ") + std::to_string(kArgs) + " operands and " +
                                       std::to_string(kRets) + " results");
  Operand ids, valid, ff, slot_of, owner_of;
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, 0, &ids));
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, 1, &valid));
  FTJAX_PLAN_TRY(get_arg<ffi::F32>(args, 2, &ff));
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, 3, &slot_of));
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, 4, &owner_of));
  if (ids.dims.size() != 2) return ffi::Error::InvalidArgument(tag("expert ids must be [T, k]"));
  const int64_t T = ids.dims[0], k = ids.dims[1], R = T * k;
  const int64_t N = slot_of.count, S = owner_of.count;
  if (n_experts < 1 || N % n_experts || layer < 0 || (layer + 1) * n_experts > N)
    return ffi::Error::InvalidArgument(tag("layer ") + std::to_string(layer) + " x " + std::to_string(n_experts) +
                                       " experts outside slot_of's " + std::to_string(N) + " ids");
  const int64_t L = N / n_experts;
  if (valid.count != T || ff.count != 1)
    return ffi::Error::InvalidArgument(tag("token_valid must be [T], fill_fraction a scalar"));
  if (fill_capacity < 0 || fill_capacity > S || fill_capacity > (R < n_experts ? R : n_experts))
    return ffi::Error::InvalidArgument(tag("fill capacity ") + std::to_string(fill_capacity) + " outside [0, min(" +
                                       std::to_string(S) + " slots, T*k, E)]");
  if (rule < kRuleBalance || rule > kRuleNone) return ffi::Error::InvalidArgument(tag("unknown rule"));
  if (split_inter < 0 || (split_inter > 0 && (split_granule < 1 || split_inter % split_granule)))
    return ffi::Error::InvalidArgument(tag("unit split: the granule must divide I"));
  a->ids = static_cast<const int32_t*>(ids.data);
  a->token_valid = static_cast<const int32_t*>(valid.data);
  a->fill_fraction = static_cast<const float*>(ff.data);
  const int64_t state_sizes[kStateCount] = {N, S, S, 1, N, L, L, L, L, L, L, N};
  int32_t* state[kStateCount];
  for (int i = 0; i < kStateCount; ++i) FTJAX_PLAN_TRY(ret_i32(rets, i, state_sizes[i], &state[i]));
  a->slot_of = state[0];
  a->owner_of = state[1];
  a->last_use = state[2];
  a->step = state[3];
  a->recency = state[4];
  for (int i = 0; i < kPlanStats; ++i) a->stats[i] = state[5 + i];
  a->hist = state[11];
  int32_t** outs[13] = {&a->route_slot, &a->cpu_routes, &a->route_units, &a->cpu_units, &a->fill_ids,
                        &a->fill_slots, &a->n_cpu_routes, &a->n_fill, &a->hits, &a->misses,
                        &a->cpu_experts, &a->deferred, &a->fill_units};
  const int64_t out_sizes[13] = {R, R, R, R, fill_capacity, fill_capacity, 1, 1, 1, 1, 1, 1, 1};
  for (int i = 0; i < 13; ++i) FTJAX_PLAN_TRY(ret_i32(rets, kStateCount + i, out_sizes[i], outs[i]));
  a->tokens = T;
  a->top_k = k;
  a->n_experts = n_experts;
  a->layer = layer;
  a->n_ids = N;
  a->n_slots = S;
  a->fill_capacity = fill_capacity;
  a->rule = static_cast<int32_t>(rule);
  a->update = update != 0;
  a->defer_horizon = static_cast<int32_t>(defer_horizon);
  a->split_inter = static_cast<int32_t>(split_inter);
  a->split_granule = static_cast<int32_t>(split_granule);
  a->rebase_at = static_cast<int32_t>(rebase_at);
  a->rebase_by = static_cast<int32_t>(rebase_by);
  a->all_units = static_cast<int32_t>(all_units);
  return ffi::Error::Success();
}

#undef FTJAX_PLAN_TRY

// The binding of both handlers (the platform's context first, where it has one).
#define FTJAX_PLAN_ATTRS(binding)                                                                       \
  (binding).RemainingArgs().RemainingRets().Attr<int64_t>("layer").Attr<int64_t>("n_experts")          \
      .Attr<int64_t>("fill_capacity").Attr<int64_t>("rule").Attr<int64_t>("update")                    \
      .Attr<int64_t>("defer_horizon").Attr<int64_t>("split_inter").Attr<int64_t>("split_granule")      \
      .Attr<int64_t>("rebase_at").Attr<int64_t>("rebase_by").Attr<int64_t>("all_units")

}  // namespace plan_ffi
}  // namespace ftjax
