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

// Operands: ids [T, k], token_valid [T] (i32), fill_fraction [] (f32), gate_weights [T, k] (f32; with
// tasks only), x [T, H] (f32 or bf16; with a publishing plan only), then the state (aliased to results 0..11): slot_of, owner_of, last_use, step, recency, six
// [L] counters, hist; then (with background only) bg_ids, bg_slots [L, C], bg_n, bg_from [L] (aliased
// to results 12..15).
constexpr int kStateCount = 12, kBgCount = 4, kPlanOuts = 13, kTaskOuts = 3, kCheckOuts = 7;
// Results: the state, [the background rows,] then route_slot, cpu_routes, route_units, cpu_units [R],
// fill_ids, fill_slots [F], n_cpu_routes, n_fill, hits, misses, cpu_experts, deferred, fill_units [],
// [then task_token, task_flat (i32), task_weight (f32) [R]], [then (kPublishChannel) the CPU branch's
// submit token [], or (kPublishCheck) the staged task_token, task_flat, task_weight, units [R], count and
// early flag [], and x's staged copy (x's shape and type)].
enum PlanPublish : int64_t { kPublishNone = 0, kPublishChannel = 1, kPublishCheck = 2 };

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

#define FTJAX_PLAN_TRY(expr)        \
  do {                              \
    ffi::Error e_ = (expr);         \
    if (e_.failure()) return e_;    \
  } while (0)

template <ffi::DataType D, class T>
inline ffi::Error ret_of(const ffi::RemainingRets& rets, int i, int64_t n, T** out) {
  auto r = rets.get<ffi::Buffer<D>>(i);
  if (!r.has_value())
    return ffi::Error::InvalidArgument(tag("result ") + std::to_string(i) +
                                       (D == ffi::F32 ? " must be float32" : " must be int32"));
  if (static_cast<int64_t>((*r)->element_count()) != n)
    return ffi::Error::InvalidArgument(tag("result ") + std::to_string(i) + " has " +
                                       std::to_string((*r)->element_count()) + " elements, expected " +
                                       std::to_string(n));
  *out = static_cast<T*>((*r)->untyped_data());
  return ffi::Error::Success();
}

// The call's static attributes.
struct PlanAttrs {
  int64_t layer, n_experts, fill_capacity, rule, update, defer_horizon, split_inter, split_granule, rebase_at,
      rebase_by, all_units, with_tasks, with_background, bg_units;
  int64_t team_threads;  // CPU handler only (tests): run plan_core on this many threads, the GPU block's form
  int64_t publish;       // PlanPublish (needs the tasks)
  int64_t channel;       // kPublishChannel: the CPU branch's channel (cuda.create_channel)
};

// A publishing plan's x operand and token result (kPublishChannel; the CUDA handler stages into the channel).
struct PublishOperands {
  const void* x = nullptr;
  int64_t x_bytes = 0, tokens = 0, hidden = 0;
  bool x_bf16 = false;
  int32_t* token = nullptr;
};

// Fills `a` (pointers of XLA's buffers: device pointers for the CUDA handler) and checks every shape.
inline ffi::Error bind(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, const PlanAttrs& at,
                       PlanArgs* a, PublishOperands* pub) {
  const bool tasks = at.with_tasks != 0, bg = at.with_background != 0;
  if (at.publish < kPublishNone || at.publish > kPublishCheck || (at.publish != kPublishNone && !tasks))
    return ffi::Error::InvalidArgument(tag("publish must be 0, 1 or 2, and needs the task arrays"));
  const bool publishes = at.publish != kPublishNone;
  const int n_args = 3 + tasks + publishes + kStateCount + (bg ? kBgCount : 0);
  const int n_rets = kStateCount + (bg ? kBgCount : 0) + kPlanOuts + (tasks ? kTaskOuts : 0) +
                     (at.publish == kPublishChannel ? 1 : at.publish == kPublishCheck ? kCheckOuts : 0);
  if (static_cast<int>(args.size()) != n_args || static_cast<int>(rets.size()) != n_rets)
    return ffi::Error::InvalidArgument(tag("expected ") + std::to_string(n_args) + " operands and " +
                                       std::to_string(n_rets) + " results");
  const int state0 = 3 + tasks + publishes;  // the first state operand
  const int64_t layer = at.layer, n_experts = at.n_experts, fill_capacity = at.fill_capacity;
  Operand ids, valid, ff, gw, slot_of, owner_of;
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, 0, &ids));
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, 1, &valid));
  FTJAX_PLAN_TRY(get_arg<ffi::F32>(args, 2, &ff));
  if (tasks) FTJAX_PLAN_TRY(get_arg<ffi::F32>(args, 3, &gw));
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, state0, &slot_of));
  FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, state0 + 1, &owner_of));
  if (ids.dims.size() != 2) return ffi::Error::InvalidArgument(tag("expert ids must be [T, k]"));
  const int64_t T = ids.dims[0], k = ids.dims[1], R = T * k;
  const int64_t N = slot_of.count, S = owner_of.count;
  if (n_experts < 1 || N % n_experts || layer < 0 || (layer + 1) * n_experts > N)
    return ffi::Error::InvalidArgument(tag("layer ") + std::to_string(layer) + " x " + std::to_string(n_experts) +
                                       " experts outside slot_of's " + std::to_string(N) + " ids");
  const int64_t L = N / n_experts;
  if (valid.count != T || ff.count != 1)
    return ffi::Error::InvalidArgument(tag("token_valid must be [T], fill_fraction a scalar"));
  if (tasks && gw.count != R) return ffi::Error::InvalidArgument(tag("gate weights must be [T, k]"));
  if (fill_capacity < 0 || fill_capacity > S || fill_capacity > (R < n_experts ? R : n_experts))
    return ffi::Error::InvalidArgument(tag("fill capacity ") + std::to_string(fill_capacity) + " outside [0, min(" +
                                       std::to_string(S) + " slots, T*k, E)]");
  if (at.rule < kRuleBalance || at.rule > kRuleNone) return ffi::Error::InvalidArgument(tag("unknown rule"));
  if (at.split_inter < 0 || (at.split_inter > 0 && (at.split_granule < 1 || at.split_inter % at.split_granule)))
    return ffi::Error::InvalidArgument(tag("unit split: the granule must divide I"));
  a->ids = static_cast<const int32_t*>(ids.data);
  a->token_valid = static_cast<const int32_t*>(valid.data);
  a->fill_fraction = static_cast<const float*>(ff.data);
  const int64_t state_sizes[kStateCount] = {N, S, S, 1, N, L, L, L, L, L, L, N};
  int32_t* state[kStateCount];
  for (int i = 0; i < kStateCount; ++i) FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, i, state_sizes[i], &state[i]));
  a->slot_of = state[0];
  a->owner_of = state[1];
  a->last_use = state[2];
  a->step = state[3];
  a->recency = state[4];
  for (int i = 0; i < kPlanStats; ++i) a->stats[i] = state[5 + i];
  a->hist = state[11];
  int ret = kStateCount;
  a->bg_ids = a->bg_slots = a->bg_n = a->bg_from = nullptr;
  a->bg_cols = 0;
  if (bg) {
    Operand bg_ids;
    FTJAX_PLAN_TRY(get_arg<ffi::S32>(args, state0 + kStateCount, &bg_ids));
    if (bg_ids.dims.size() != 2 || bg_ids.dims[0] != L || bg_ids.dims[1] < fill_capacity)
      return ffi::Error::InvalidArgument(tag("background rows must be [L, >= F]"));
    a->bg_cols = bg_ids.dims[1];
    const int64_t bg_sizes[kBgCount] = {L * a->bg_cols, L * a->bg_cols, L, L};
    int32_t** bg_outs[kBgCount] = {&a->bg_ids, &a->bg_slots, &a->bg_n, &a->bg_from};
    for (int i = 0; i < kBgCount; ++i) FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret + i, bg_sizes[i], bg_outs[i]));
    if (!at.bg_units) a->bg_from = nullptr;
    ret += kBgCount;
  }
  int32_t** outs[kPlanOuts] = {&a->route_slot, &a->cpu_routes, &a->route_units, &a->cpu_units, &a->fill_ids,
                               &a->fill_slots, &a->n_cpu_routes, &a->n_fill, &a->hits, &a->misses,
                               &a->cpu_experts, &a->deferred, &a->fill_units};
  const int64_t out_sizes[kPlanOuts] = {R, R, R, R, fill_capacity, fill_capacity, 1, 1, 1, 1, 1, 1, 1};
  for (int i = 0; i < kPlanOuts; ++i) FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret + i, out_sizes[i], outs[i]));
  ret += kPlanOuts;
  a->gate_weights = tasks ? static_cast<const float*>(gw.data) : nullptr;
  a->task_token = a->task_flat = nullptr;
  a->task_weight = nullptr;
  if (tasks) {
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret, R, &a->task_token));
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret + 1, R, &a->task_flat));
    FTJAX_PLAN_TRY(ret_of<ffi::F32>(rets, ret + 2, R, &a->task_weight));
    ret += kTaskOuts;
  }
  a->stage_token = a->stage_flat = a->stage_units = a->staged_n = a->staged_early = nullptr;
  a->stage_weight = nullptr;
  a->x_words = nullptr;
  a->stage_x = nullptr;
  a->x_word_count = 0;
  *pub = PublishOperands{};
  if (publishes) {
    auto x = args.get<ffi::AnyBuffer>(3 + tasks);
    if (!x.has_value()) return ffi::Error::InvalidArgument(tag("x must be a buffer"));
    const auto xd = x->dimensions();
    const bool bf16 = x->element_type() == ffi::DataType::BF16;
    if (xd.size() != 2 || xd[0] != T || (!bf16 && x->element_type() != ffi::DataType::F32) || x->size_bytes() % 4)
      return ffi::Error::InvalidArgument(tag("x must be f32 or bf16 [T, H] with T the ids' T (and 4-byte rows)"));
    pub->x = x->untyped_data();
    pub->x_bytes = static_cast<int64_t>(x->size_bytes());
    pub->tokens = T;
    pub->hidden = xd[1];
    pub->x_bf16 = bf16;
  }
  if (at.publish == kPublishChannel) {
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret, 1, &pub->token));
  } else if (at.publish == kPublishCheck) {
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret, R, &a->stage_token));
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret + 1, R, &a->stage_flat));
    FTJAX_PLAN_TRY(ret_of<ffi::F32>(rets, ret + 2, R, &a->stage_weight));
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret + 3, R, &a->stage_units));
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret + 4, 1, &a->staged_n));
    FTJAX_PLAN_TRY(ret_of<ffi::S32>(rets, ret + 5, 1, &a->staged_early));
    auto xs = rets.get<ffi::AnyBuffer>(ret + 6);
    if (!xs.has_value() || static_cast<int64_t>((*xs)->size_bytes()) != pub->x_bytes)
      return ffi::Error::InvalidArgument(tag("the staged x must have x's size"));
    a->x_words = static_cast<const uint32_t*>(pub->x);  // x staged as a publishing plan stages it
    a->stage_x = static_cast<uint32_t*>((*xs)->untyped_data());
    a->x_word_count = pub->x_bytes / 4;
  }
  a->tokens = T;
  a->top_k = k;
  a->n_experts = n_experts;
  a->layer = layer;
  a->n_ids = N;
  a->n_slots = S;
  a->fill_capacity = fill_capacity;
  a->rule = static_cast<int32_t>(at.rule);
  a->update = at.update != 0;
  a->defer_horizon = static_cast<int32_t>(at.defer_horizon);
  a->split_inter = static_cast<int32_t>(at.split_inter);
  a->split_granule = static_cast<int32_t>(at.split_granule);
  a->rebase_at = static_cast<int32_t>(at.rebase_at);
  a->rebase_by = static_cast<int32_t>(at.rebase_by);
  a->all_units = static_cast<int32_t>(at.all_units);
  return ffi::Error::Success();
}

#undef FTJAX_PLAN_TRY

// The binding of both handlers (the platform's context first, where it has one): the attributes in
// PlanAttrs' order.
#define FTJAX_PLAN_ATTRS(binding)                                                                       \
  (binding).RemainingArgs().RemainingRets().Attr<int64_t>("layer").Attr<int64_t>("n_experts")          \
      .Attr<int64_t>("fill_capacity").Attr<int64_t>("rule").Attr<int64_t>("update")                    \
      .Attr<int64_t>("defer_horizon").Attr<int64_t>("split_inter").Attr<int64_t>("split_granule")      \
      .Attr<int64_t>("rebase_at").Attr<int64_t>("rebase_by").Attr<int64_t>("all_units")                \
      .Attr<int64_t>("with_tasks").Attr<int64_t>("with_background").Attr<int64_t>("bg_units")          \
      .Attr<int64_t>("team_threads").Attr<int64_t>("publish").Attr<int64_t>("channel")
#define FTJAX_PLAN_ATTR_PARAMS                                                                          \
  int64_t layer, int64_t n_experts, int64_t fill_capacity, int64_t rule, int64_t update, int64_t defer_horizon, \
      int64_t split_inter, int64_t split_granule, int64_t rebase_at, int64_t rebase_by, int64_t all_units,      \
      int64_t with_tasks, int64_t with_background, int64_t bg_units, int64_t team_threads, int64_t publish,         \
      int64_t channel
#define FTJAX_PLAN_ATTR_VALUES                                                                          \
  plan_ffi::PlanAttrs { layer, n_experts, fill_capacity, rule, update, defer_horizon, split_inter, split_granule, \
                        rebase_at, rebase_by, all_units, with_tasks, with_background, bg_units, team_threads,  \
                        publish, channel }

}  // namespace plan_ffi
}  // namespace ftjax
