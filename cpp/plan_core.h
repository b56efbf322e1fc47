// The plan of one MoE layer call (ftjax/experts/plan.py `plan_layer`, its reference), as one pass over
// the cache state: the same outputs and state updates, bit for bit (tested against the jnp plan on the
// CPU backend and on the GPU). One source for both platforms: `plan_core` is written against a "team"
// (`each`, `sum`, `min_u64`, `compact`, `sync`): the CPU handler runs it with one thread (plan_cpu.cc),
// the CUDA handler with one thread block (plan_cuda.cu), so a decode layer's plan is one kernel instead
// of XLA's chain of ~20 small ones; a test handler runs it on n host threads in the block's form (`add_i32`
// is the team's atomic add). The includer defines FTJAX_PLAN_FN (`__device__` or empty).
#pragma once
#include <cstdint>

#ifndef FTJAX_PLAN_FN
#error "define FTJAX_PLAN_FN (__device__, or empty for the host) before including plan_core.h"
#endif

namespace ftjax {

constexpr int kPlanStats = 6;  // ftjax.experts.cache.STAT_KEYS: hits, misses, fills, cpu_experts, deferred, calls
enum PlanRule : int32_t { kRuleBalance = 0, kRuleAll = 1, kRuleNone = 2 };

struct PlanArgs {
  // inputs
  const int32_t* ids;          // [T*k] router ids of the layer, in [0, E)
  const int32_t* token_valid;  // [T] nonzero: a real token
  const float* fill_fraction;  // [] f = B_P / B_H
  // cache state, read and updated in place
  int32_t* slot_of;   // [N]
  int32_t* owner_of;  // [S]
  int32_t* last_use;  // [S]
  int32_t* step;      // []
  int32_t* recency;   // [N]
  int32_t* stats[kPlanStats];  // [L] each
  int32_t* hist;      // [N]
  // the plan (LayerPlan)
  int32_t* route_slot;   // [R]
  int32_t* cpu_routes;   // [R]
  int32_t* route_units;  // [R]
  int32_t* cpu_units;    // [R] (holds the slot before the call of a route whose id is outside [0, E))
  int32_t* fill_ids;     // [F]
  int32_t* fill_slots;   // [F]
  int32_t* n_cpu_routes;
  int32_t* n_fill;
  int32_t* hits;
  int32_t* misses;
  int32_t* cpu_experts;
  int32_t* deferred;
  int32_t* fill_units;
  // optional (nullptr: not asked for): the CPU branch's task arrays in cpu_routes order (the route's
  // token, flat id and gate weight), from the gate weights [R]
  const float* gate_weights;
  int32_t* task_token;
  int32_t* task_flat;
  float* task_weight;
  // optional: the decode step's background rows [L, bg_cols] / [L], row `layer` written (ftjax/experts/
  // plan.py record_background): the fills, their count if deferred, and (bg_from) the first unit
  int32_t* bg_ids;
  int32_t* bg_slots;
  int32_t* bg_n;
  int32_t* bg_from;
  int64_t bg_cols;
  // optional (nullptr: not asked for; needs the task arrays): the CPU branch's staged copy of its task list,
  // in the task arrays' order with each task's unit start, written as soon as it is known: before the
  // victims are chosen (the CPU's tasks never depend on which slots the fills evict), or, when a valid
  // route's router id lies outside [0, E) (its slot after the call is read after the evictions), after the
  // routes; then the team's `publish(n)`. plan_cuda.cu points these into a channel's mapped staging (the
  // CPU branch starts from inside the plan kernel: no submit kernel); the check form (tests) into results.
  int32_t* stage_token;
  int32_t* stage_flat;
  float* stage_weight;
  int32_t* stage_units;
  int32_t* staged_n;      // optional: the staged count
  int32_t* staged_early;  // optional: 1 if staged before the victims
  const uint32_t* x_words;  // optional: x, copied into stage_x in the first pass
  uint32_t* stage_x;
  int64_t x_word_count;
  // static
  int64_t tokens, top_k, n_experts, layer, n_ids, n_slots, fill_capacity;
  int32_t rule, update, defer_horizon;
  int32_t split_inter, split_granule;  // unit split (I, granule); split_inter 0: none
  int32_t rebase_at, rebase_by;        // the LRU clock's rebase (plan.py REBASE_AT / REBASE_BY)
  int32_t all_units;                   // plan.py ALL_UNITS
};

// Scratch of one call (shared memory on the GPU): 3 E + 4 x min(T*k, E) + 3 x F + 1 int32, then optionally
// the per-route copies (4 R more: the router ids, the gate weights, each route's slot and units) and the
// per-slot copies (2 S more: last_use and owner_of). The GPU makes the per-route copies where they fit
// (the routes' phases then read shared memory only) and the per-slot ones where they fit and the call can
// fill (F > 0: the evictable count, the victims' reductions and the evicted owners then read the copies).
// Every global load the plan depends on is issued in its first pass (the ids, each routed expert's slot
// and recency, the gate weights, the per-slot copies): a block's phase that waits on global memory costs
// ~0.7 us on the H200, and the phases after the first one read shared memory only.
struct PlanScratch {
  int32_t* pos;        // [E] 1 + the expert's index in uniq, 0: not routed
  int32_t* slot_e;     // [E] slot_of of each routed expert, before the call (read in the first pass)
  int32_t* rec_e;      // [E] recency of each routed expert, before the call
  int32_t* uniq;       // [U] ascending present ids, then E
  int32_t* slot_u;     // [U] slot before the call
  int32_t* rec_u;      // [U] recency before the call
  int32_t* slot_new;   // [U] slot after the call's fills
  int32_t* fill_list;  // [F] flat ids to fill, in fill order
  int32_t* fill_u;     // [F] their index in uniq
  int32_t* victims;    // [F]
  int32_t* odd;        // [1] nonzero: a valid route's router id lies outside [0, E)
  int32_t* ids_copy;   // [R] or nullptr: the per-route arrays are read and written in place
  float* gw;           // [R] the gate weights (per-route copies only)
  int32_t* rs;         // [R] each route's slot after the call (per-route copies only)
  int32_t* ru;         // [R] each route's units (per-route copies only)
  int32_t* lu;         // [S] last_use: the copy, or the state itself
  int32_t* own;        // [S] owner_of: the copy, or the state itself
  bool lu_copy;
};

inline int64_t plan_scratch_ints(int64_t routes, int64_t n_experts, int64_t fill_capacity, int64_t slots,
                                 bool ids_copy, bool lu_copy) {
  const int64_t U = routes < n_experts ? routes : n_experts;
  return 3 * n_experts + 4 * U + 3 * fill_capacity + 1 + (ids_copy ? 4 * routes : 0) + (lu_copy ? 2 * slots : 0);
}

FTJAX_PLAN_FN inline PlanScratch plan_scratch(int32_t* base, int64_t routes, int64_t n_experts, int64_t F,
                                              int64_t slots, int32_t* last_use, int32_t* owner_of, bool ids_copy,
                                              bool lu_copy) {
  const int64_t U = routes < n_experts ? routes : n_experts;
  PlanScratch s;
  s.pos = base;
  s.slot_e = s.pos + n_experts;
  s.rec_e = s.slot_e + n_experts;
  s.uniq = s.rec_e + n_experts;
  s.slot_u = s.uniq + U;
  s.rec_u = s.slot_u + U;
  s.slot_new = s.rec_u + U;
  s.fill_list = s.slot_new + U;
  s.fill_u = s.fill_list + F;
  s.victims = s.fill_u + F;
  s.odd = s.victims + F;
  int32_t* next = s.odd + 1;
  s.ids_copy = s.rs = s.ru = nullptr;
  s.gw = nullptr;
  if (ids_copy) {
    s.ids_copy = next;
    s.rs = next + routes;
    s.ru = next + 2 * routes;
    s.gw = reinterpret_cast<float*>(next + 3 * routes);  // (only ever accessed as float)
    next += 4 * routes;
  }
  s.lu = lu_copy ? next : last_use;
  s.own = lu_copy ? next + slots : owner_of;
  s.lu_copy = lu_copy;
  return s;
}

FTJAX_PLAN_FN inline int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }
FTJAX_PLAN_FN inline int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }
FTJAX_PLAN_FN inline float fclip01(float f) { return f < 0.0f ? 0.0f : (f > 1.0f ? 1.0f : f); }
FTJAX_PLAN_FN inline float fmax2(float a, float b) { return a > b ? a : b; }

// plan.balance_fill: floor(m f) or floor(m f) + 1, whichever makes the slower side faster; >= 1 when m > 0.
FTJAX_PLAN_FN inline int32_t plan_balance_fill(int32_t m, float f) {
  f = fclip01(f);
  const float mf = static_cast<float>(m);
  int32_t lo = static_cast<int32_t>(mf * f);  // m f >= 0: truncation is the floor
  lo = imin(lo, m);
  const int32_t hi = imin(lo + 1, m);
  const float g = 1.0f - f;
  const float s_lo = fmax2(static_cast<float>(lo) * g, (mf - static_cast<float>(lo)) * f);
  const float s_hi = fmax2(static_cast<float>(hi) * g, (mf - static_cast<float>(hi)) * f);
  const int32_t n = s_hi < s_lo ? hi : lo;
  return m > 0 ? imax(n, 1) : 0;
}

// plan.defer_fills.
FTJAX_PLAN_FN inline bool plan_defer_fills(int32_t m, int32_t n_fill, float f) {
  f = fclip01(f);
  const float mf = static_cast<float>(m), nf = static_cast<float>(n_fill);
  return n_fill > 0 && mf * f < fmax2(nf * (1.0f - f), (mf - nf) * f);
}

// Round half to even (jnp.round) of a value in [0, 2^24).
FTJAX_PLAN_FN inline int32_t round_even(float x) {
  int32_t r = static_cast<int32_t>(x);
  const float d = x - static_cast<float>(r);
  if (d > 0.5f || (d == 0.5f && (r & 1))) ++r;
  return r;
}

// plan.split_units.
FTJAX_PLAN_FN inline int32_t plan_split_units(int32_t m, int32_t n_fill, float f, int32_t inter, int32_t granule) {
  f = fclip01(f);
  float q = static_cast<float>(m) * f / static_cast<float>(imax(n_fill, 1));
  q = q < 1.0f ? q : 1.0f;
  const int32_t steps = inter / granule;
  const int32_t u = round_even(q * static_cast<float>(steps)) * granule;
  return imin(imax(u, 0), inter);
}

// The LRU order of slots: older last_use first, ties to the lower slot (a total order).
constexpr int32_t kPendingSlot = 0x7fffffff;  // a fill's slot until its victim is chosen

FTJAX_PLAN_FN inline uint64_t lru_key(int32_t last_use, int64_t slot) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(last_use) ^ 0x80000000u) << 32) | static_cast<uint64_t>(slot);
}

template <class Team>
FTJAX_PLAN_FN void plan_core(const Team& t, const PlanArgs& a, const PlanScratch& s) {
  const int64_t E = a.n_experts, R = a.tokens * a.top_k, N = a.n_ids, S = a.n_slots, F = a.fill_capacity;
  const int64_t U = R < E ? R : E, base = a.layer * E;
  const bool split = a.split_inter > 0;
  const bool defer = a.defer_horizon > 0;
  const float ff = *a.fill_fraction;
  const int32_t num_units = split ? a.split_inter : a.all_units;
  auto clamp_flat = [&](int64_t f) { return f < 0 ? int64_t{0} : (f >= N ? N - 1 : f); };  // jnp's gather
  auto route_valid = [&](int64_t r) { return a.token_valid[r / a.top_k] != 0; };
  auto route_id = [&](int64_t r) { return s.ids_copy ? s.ids_copy[r] : a.ids[r]; };
  int32_t* lu = s.lu;

  // The LRU clock: layer 0 rebases it (plan.rebase_clock) once it passes rebase_at.
  const int32_t step0 = *a.step;
  const int32_t shift = (a.layer == 0 && a.update && step0 >= a.rebase_at) ? a.rebase_by : 0;
  auto back = [&](int32_t v) { return v >= 0 ? imax(v - shift, 0) : v; };
  if (shift) t.each(N, [&](int64_t i) { a.recency[i] = back(a.recency[i]); });
  const int32_t step = step0 - shift + 1;

  // One pass issues every global load the plan depends on: the router ids (kept), the gate weights, the
  // layer's routed experts with their slots and recency, the histogram, and last_use / owner_of (into the
  // copies, last_use rebased). (The recency read here follows the rebase: a barrier lies between.)
  const bool staging = a.stage_token != nullptr;
  t.each(E, [&](int64_t e) { s.pos[e] = 0; });
  t.each(1, [&](int64_t) { *s.odd = 0; });
  t.sync();
  t.each(R, [&](int64_t r) {
    const int32_t id = a.ids[r];
    if (s.ids_copy) s.ids_copy[r] = id;
    if (s.gw && a.gate_weights) s.gw[r] = a.gate_weights[r];
    const bool v = route_valid(r);
    const int64_t f = base + id;
    if (v && id >= 0 && id < E) {  // (routes of one expert store the same values)
      s.pos[id] = 1;
      s.slot_e[id] = a.slot_of[f];
      s.rec_e[id] = a.recency[f];
    }
    if (v && (id < 0 || id >= E)) {
      a.cpu_units[r] = a.slot_of[clamp_flat(f)];  // its slot before the call
      if (staging) t.add_i32(s.odd, 1);
    }
    if (v && f >= 0 && f < N) t.add_i32(&a.hist[f], 1);
  });
  // (eight entries per thread and pass, their loads issued together: a plain strided loop waits for each
  // load in turn, ~0.7 us a pass on the GPU, 8 passes for 3,788 slots; x's staged copy rides along)
  constexpr int kChunk = 8;
  const int64_t lu_chunks = (s.lu_copy || shift) ? (S + kChunk - 1) / kChunk : 0;
  const int64_t x_chunks = a.stage_x ? (a.x_word_count + kChunk - 1) / kChunk : 0;
  t.each(lu_chunks > x_chunks ? lu_chunks : x_chunks, [&](int64_t c) {
    int32_t v[kChunk], o[kChunk];
    uint32_t xw[kChunk];
    const int64_t i0 = c * kChunk;
    const int64_t n = c < lu_chunks ? (S - i0 < kChunk ? S - i0 : kChunk) : 0;
    // (x's words interleaved, word q * x_chunks + c: on the GPU a warp's stores to the mapped staging are
    // then 32 consecutive words, one PCIe write each, not 32 scattered ones)
    const auto xi = [&](int q) { return q * x_chunks + c; };
    const bool xc = c < x_chunks;
    for (int q = 0; q < kChunk; ++q) {
      v[q] = q < n ? a.last_use[i0 + q] : 0;
      o[q] = (s.lu_copy && q < n) ? a.owner_of[i0 + q] : 0;
      xw[q] = (xc && xi(q) < a.x_word_count) ? a.x_words[xi(q)] : 0u;
    }
    for (int q = 0; q < kChunk; ++q) {
      if (q < n) {
        lu[i0 + q] = back(v[q]);
        if (s.lu_copy) s.own[i0 + q] = o[q];
      }
      if (xc && xi(q) < a.x_word_count) a.stage_x[xi(q)] = xw[q];
    }
  });
  t.sync();
  const int64_t n_uniq = t.compact(E, [&](int64_t e) { return s.pos[e] != 0; },
                                   [&](int64_t q, int64_t e) { s.uniq[q] = static_cast<int32_t>(e); });
  t.each(U - n_uniq, [&](int64_t j) { s.uniq[n_uniq + j] = static_cast<int32_t>(E); });
  t.sync();

  // Hits and misses (from the first pass's reads); the hits are used in this step (never victims).
  t.each(U, [&](int64_t i) {
    const bool valid = s.uniq[i] < E;
    const int32_t slot = valid ? s.slot_e[s.uniq[i]] : -1;
    if (valid) s.pos[s.uniq[i]] = static_cast<int32_t>(i) + 1;
    s.slot_u[i] = slot;
    s.slot_new[i] = slot;
    s.rec_u[i] = valid ? s.rec_e[s.uniq[i]] : 0;
    if (a.update && slot >= 0) lu[slot] = step;
  });
  t.sync();
  // misses in the high half, hits in the low one: one reduction
  const int64_t counted = t.sum(U, [&](int64_t i) {
    return s.slot_u[i] >= 0 ? int64_t{1} : (s.uniq[i] < E ? int64_t{1} << 32 : int64_t{0});
  });
  const int32_t m = static_cast<int32_t>(counted >> 32);
  const int32_t hits = static_cast<int32_t>(counted & 0xffffffff);

  int32_t n_fill = 0, units = num_units;
  bool deferred = false;
  if (F > 0) {
    const int32_t want = a.rule == kRuleAll ? m : plan_balance_fill(m, ff);
    const int32_t evictable = static_cast<int32_t>(t.sum(S, [&](int64_t i) { return lu[i] < step; }));
    n_fill = imin(imin(want, static_cast<int32_t>(F)), imin(evictable, static_cast<int32_t>(F)));
    if (defer && split) {
      units = plan_split_units(m, n_fill, ff, a.split_inter, a.split_granule);
      deferred = n_fill > 0 && units < a.split_inter;
    } else if (defer) {
      deferred = plan_defer_fills(m, n_fill, ff);
    }
    // The misses to fill: most recently routed first, ties to the lower id (plan.rank_misses).
    t.each(U, [&](int64_t i) {
      if (!(s.uniq[i] < E && s.slot_u[i] < 0)) return;
      int32_t rank = 0;
      for (int64_t j = 0; j < U; ++j) {
        if (!(s.uniq[j] < E && s.slot_u[j] < 0)) continue;
        rank += s.rec_u[j] > s.rec_u[i] || (s.rec_u[j] == s.rec_u[i] && s.uniq[j] < s.uniq[i]);
      }
      if (rank < n_fill) {
        s.fill_list[rank] = static_cast<int32_t>(base + s.uniq[i]);
        s.fill_u[rank] = static_cast<int32_t>(i);
        s.slot_new[i] = kPendingSlot;  // (its victim is chosen below; the CPU's tasks need only the sign)
      }
    });
    t.sync();
  }

  // Routes: slot after the updates; the unit split's units; a deferred call's misses to the CPU. A
  // routed expert's slots come from the per-expert arrays; a router id outside [0, E) reads slot_of at
  // the clamped flat id, before and after the updates (the jnp plan's gather), like the reference.
  const bool split_call = defer && split && F > 0;
  auto slots_of = [&](int64_t r, int32_t* before, int32_t* after) {
    const int32_t id = route_id(r);
    if (!route_valid(r)) {
      *before = -1;
      *after = -1;
    } else if (id >= 0 && id < E) {  // a valid route's expert is in uniq
      *before = s.slot_u[s.pos[id] - 1];
      *after = s.slot_new[s.pos[id] - 1];
    } else {
      *before = a.cpu_units[r];
      *after = a.slot_of[clamp_flat(base + id)];
    }
  };
  auto route_plan = [&](int64_t r, int32_t* slot, int32_t* ru) {
    int32_t before;
    slots_of(r, &before, slot);
    *ru = num_units;
    const bool missed = before < 0;
    if (split_call) {
      if (deferred && missed && *slot >= 0) *ru = units;
    } else if (defer && deferred && missed) {
      *slot = -1;
    }
  };
  auto stage = [&](int64_t j, int64_t r, int32_t slot, int32_t ru) {
    a.stage_token[j] = static_cast<int32_t>(r / a.top_k);
    a.stage_flat[j] = static_cast<int32_t>(base) + route_id(r);
    a.stage_weight[j] = s.gw ? s.gw[r] : a.gate_weights[r];
    a.stage_units[j] = slot >= 0 ? ru : 0;
  };
  auto staged = [&](int64_t n, int32_t early) {
    t.each(1, [&](int64_t) {
      if (a.staged_n) *a.staged_n = static_cast<int32_t>(n);
      if (a.staged_early) *a.staged_early = early;
    });
    t.publish(n);
  };
  // The CPU branch's tasks, staged before the victims (the fills' victims change no task).
  const bool stage_early = staging && *s.odd == 0;
  if (stage_early) {
    auto on_cpu = [&](int64_t r) {
      int32_t slot, ru;
      route_plan(r, &slot, &ru);
      return route_valid(r) && (slot < 0 || ru < num_units);
    };
    const int64_t n = t.compact(R, on_cpu, [&](int64_t j, int64_t r) {
      int32_t slot, ru;
      route_plan(r, &slot, &ru);
      stage(j, r, slot, ru);
    });
    staged(n, 1);
  }

  if (F > 0) {
    // Victims: the n_fill least recently used slots, in LRU order (one reduction each).
    uint64_t prev = 0;
    for (int32_t j = 0; j < n_fill; ++j) {
      const bool first = j == 0;
      const uint64_t key = t.min_u64(S, [&](int64_t i) {
        const uint64_t k = lru_key(lu[i], i);
        return (first || k > prev) ? k : ~uint64_t{0};
      });
      t.each(1, [&](int64_t) { s.victims[j] = static_cast<int32_t>(key & 0xffffffffu); });
      prev = key;
    }
    t.sync();
    const int32_t stamp = (defer && deferred) ? step + a.defer_horizon : step;
    t.each(F, [&](int64_t j) {
      if (j >= n_fill) {
        a.fill_ids[j] = 0;
        a.fill_slots[j] = 0;
        return;
      }
      const int32_t id = s.fill_list[j], v = s.victims[j];
      const int32_t old = s.own[v];  // (the victims differ: no other fill touches this entry)
      if (old >= 0) a.slot_of[old] = -1;  // evicted ids are resident, filled ids missed: disjoint
      a.slot_of[id] = v;
      a.owner_of[v] = id;
      lu[v] = stamp;
      s.slot_new[s.fill_u[j]] = v;
      a.fill_ids[j] = id;
      a.fill_slots[j] = v;
    });
    if (a.bg_ids)
      t.each(F, [&](int64_t j) {
        a.bg_ids[a.layer * a.bg_cols + j] = j < n_fill ? s.fill_list[j] : 0;
        a.bg_slots[a.layer * a.bg_cols + j] = j < n_fill ? s.victims[j] : 0;
      });
    t.sync();
  }

  t.each(R, [&](int64_t r) {
    int32_t slot, ru;
    route_plan(r, &slot, &ru);
    a.route_slot[r] = slot;
    a.route_units[r] = ru;
    if (s.rs) {
      s.rs[r] = slot;
      s.ru[r] = ru;
    }
  });
  t.sync();
  // The CPU routes first, then the rest (stable), each route's entries written where the compaction puts
  // it: cpu_routes, cpu_units and the task arrays (cpu_units, the slot before the call of an out-of-range
  // id until here, was last read above).
  auto slot_at = [&](int64_t r) { return s.rs ? s.rs[r] : a.route_slot[r]; };
  auto units_at = [&](int64_t r) { return s.ru ? s.ru[r] : a.route_units[r]; };
  auto on_cpu = [&](int64_t r) { return route_valid(r) && (slot_at(r) < 0 || units_at(r) < num_units); };
  auto emit = [&](int64_t j, int64_t r) {
    a.cpu_routes[j] = static_cast<int32_t>(r);
    a.cpu_units[j] = slot_at(r) >= 0 ? units_at(r) : 0;
    if (a.task_token) {
      a.task_token[j] = static_cast<int32_t>(r / a.top_k);
      a.task_flat[j] = static_cast<int32_t>(base) + route_id(r);
      a.task_weight[j] = s.gw ? s.gw[r] : a.gate_weights[r];
    }
  };
  const int64_t n_cpu = t.compact(R, on_cpu, [&](int64_t j, int64_t r) {
    emit(j, r);
    if (staging && !stage_early) stage(j, r, slot_at(r), units_at(r));
  });
  t.compact(R, [&](int64_t r) { return !on_cpu(r); }, [&](int64_t q, int64_t r) { emit(n_cpu + q, r); });
  if (staging && !stage_early) staged(n_cpu, 0);
  // Recency of the routed experts; last_use back from the copy; counters; the clock (stores and atomic
  // adds: nothing in the call waits for them).
  t.each(U, [&](int64_t i) {
    if (s.uniq[i] < E) a.recency[base + s.uniq[i]] = step;
  });
  if (s.lu_copy) t.each(S, [&](int64_t i) { a.last_use[i] = lu[i]; });
  const int32_t cpu_experts = deferred ? m : m - n_fill;
  const int32_t fill_units = split_call && deferred ? units : num_units;
  t.each(1, [&](int64_t) {
    *a.n_cpu_routes = static_cast<int32_t>(n_cpu);
    *a.n_fill = n_fill;
    *a.hits = hits;
    *a.misses = m;
    *a.cpu_experts = cpu_experts;
    *a.deferred = deferred;
    *a.fill_units = fill_units;
    const int32_t counts[kPlanStats] = {hits, m, n_fill, cpu_experts, deferred ? n_fill : 0, 1};
    for (int i = 0; i < kPlanStats; ++i) t.add_i32(&a.stats[i][a.layer], counts[i]);
    if (a.bg_n && F > 0) {
      a.bg_n[a.layer] = deferred ? n_fill : 0;
      if (a.bg_from) a.bg_from[a.layer] = deferred ? fill_units : 0;
    }
    *a.step = step;
  });
}

}  // namespace ftjax
