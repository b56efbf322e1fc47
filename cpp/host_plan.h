// The host plan: the CPU branch's task list of a decode layer call decided on the host, from what the GPU
// gathers before its own plan kernel (cpu_experts_publish, handshake.cu), so that the CPU expert call starts
// right after the router instead of after the plan kernel and the submit kernel.
//
// The task list of plan_core (plan_core.h) depends on the cache state only through each routed expert's slot
// (hit or miss) and recency (the fill order of the misses) and through how many slots are evictable (the cap
// on the fills); not on which slots the fills evict. host_plan_tasks runs plan_core itself, on the host, over
// a small stand-in state that has exactly those values: the layer's routed experts with their slots (renamed,
// in order) and recency, and as many evictable slots as the real cache has (up to the fill capacity). Its
// task list is the device plan's, bit for bit (tests/experts/test_host_plan.py, against the fused plan); the
// GPU's collect checks each call's list against its own plan (task_checksum) and fails the call if they
// differ, never a silent error.
#pragma once
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define FTJAX_HD __host__ __device__
#else
#define FTJAX_HD
#endif

namespace ftjax {

// The plan's static parameters (the fused plan's attributes, plan_ffi.h PlanAttrs), per call.
struct HostPlanStatics {
  int64_t tokens = 0, top_k = 0, n_experts = 0, layer = 0, fill_capacity = 0;
  int32_t rule = 0, update = 0, defer_horizon = 0, split_inter = 0, split_granule = 0;
  int32_t rebase_at = 0, rebase_by = 0, all_units = 0;
};

// The statics' wire order (HandshakeCtrl::plan; the publish call's attributes).
enum PlanStatic : int32_t {
  kPsExperts = 0, kPsLayer, kPsFillCapacity, kPsRule, kPsUpdate, kPsDeferHorizon, kPsSplitInter, kPsSplitGranule,
  kPsRebaseAt, kPsRebaseBy, kPsAllUnits, kPlanStatics
};

// Their names (plan_fused.plan_statics' keys, the publish call's attributes), in that order.
inline constexpr const char* kPlanStaticNames[kPlanStatics] = {
    "n_experts", "layer", "fill_capacity", "rule", "update", "defer_horizon", "split_inter", "split_granule",
    "rebase_at", "rebase_by", "all_units"};

inline HostPlanStatics host_plan_statics(int64_t tokens, int64_t top_k, const int32_t* plan) {
  HostPlanStatics s;
  s.tokens = tokens;
  s.top_k = top_k;
  s.n_experts = plan[kPsExperts];
  s.layer = plan[kPsLayer];
  s.fill_capacity = plan[kPsFillCapacity];
  s.rule = plan[kPsRule];
  s.update = plan[kPsUpdate];
  s.defer_horizon = plan[kPsDeferHorizon];
  s.split_inter = plan[kPsSplitInter];
  s.split_granule = plan[kPsSplitGranule];
  s.rebase_at = plan[kPsRebaseAt];
  s.rebase_by = plan[kPsRebaseBy];
  s.all_units = plan[kPsAllUnits];
  return s;
}

// What the GPU gathers for the call (state before the call's plan), per route r of R = tokens * top_k.
struct HostPlanInputs {
  const int32_t* ids = nullptr;      // [R] router ids, in [0, E) for every valid route
  const int32_t* valid = nullptr;    // [tokens] nonzero: a real token
  const float* gate = nullptr;       // [R] gate weights
  const int32_t* slot = nullptr;     // [R] slot_of[layer E + id] (-1: not cached)
  const int32_t* recency = nullptr;  // [R] recency[layer E + id], as stored (before any rebase)
  const int32_t* slot_lu = nullptr;  // [R] last_use[slot] as stored, for routes with a slot
  int32_t step = 0;                  // the state's step counter
  int32_t below = 0;                 // slots whose last_use (rebased) is below the call's step (read when F > 0)
  float fill_fraction = 0.f;
};

// The CPU branch's tasks in the plan's order (cpu_routes): token, flat id, gate weight, unit start.
struct HostPlanTasks {
  std::vector<int32_t> token, flat, units;
  std::vector<float> weight;
  int64_t n = 0;
  uint32_t checksum = 0;  // task_checksum summed over the tasks
};

// Throws std::invalid_argument for bad statics or a valid route's id outside [0, E).
void host_plan_tasks(const HostPlanStatics& s, const HostPlanInputs& in, HostPlanTasks* out);

// One task's share of a task list's checksum (a sum: the list's order does not count), the same on the
// host and in the GPU's collect.
FTJAX_HD inline uint32_t task_checksum(int32_t token, int32_t flat, int32_t unit, uint32_t weight_bits) {
  uint32_t h = static_cast<uint32_t>(token) * 0x9E3779B1u;
  h ^= static_cast<uint32_t>(flat) * 0x85EBCA77u + 0x165667B1u;
  h = (h << 13) | (h >> 19);
  h ^= static_cast<uint32_t>(unit) * 0xC2B2AE3Du;
  h = (h << 11) | (h >> 21);
  h ^= weight_bits * 0x27D4EB2Fu;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  h *= 0x297A2D39u;
  h ^= h >> 15;
  return h;
}

}  // namespace ftjax
