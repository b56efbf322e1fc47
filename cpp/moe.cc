#include "moe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ftjax {
namespace {
constexpr int64_t kRowsPhase1 = 16;  // gate rows (and as many up rows) per work item (default of gate_up_item_rows)
// Output rows of down per work item (the default of down_item_rows): 32 read a 1-token expert's down
// windows [u, I) 5-8% faster than 16 on the H200 host (each item restarts its rows' prefetch), and the
// decode step's down round 4-7% faster (bench/RESULTS.md session 27).
constexpr int64_t kRowsPhase2 = 32;
constexpr int64_t kMinItemsPerThread = 4;  // below it, items of half the rows (load balance)
constexpr int64_t kMinClaimBytes = 32 << 10;  // weight bytes a thread claims at once, at least
constexpr int64_t kVnniColumns = 512;  // columns of a group's B-tile layout per layout item (a multiple of 32)
// A transposed down: a call whose gate/up items' partial outputs (an item's routes x H floats each) take at most
// kFusedPartialFloats in all (4 MiB: batch-1 decode of one Qwen3.6 expert is 64 items of 8 KiB) sums each item's down
// rows into its own partial in phase 1 (no barrier between a unit's gate/up rows and its down row), then phase 2 adds
// the partials token by token in item order (the same sums in the same order, whichever thread ran an item: results
// do not depend on the schedule), in blocks of at most kSumColumns outputs (fewer for balance, down to one 64-byte
// line: the partials are read from the other cores' caches, so every thread should take a share). Larger calls run
// down by column blocks of kAxpyColumns (halved for balance down to kMinAxpyColumns: 128 bytes of a bf16 row).
constexpr int64_t kFusedPartialFloats = int64_t{1} << 20, kAxpyColumns = 256, kMinAxpyColumns = 64, kSumColumns = 256;
constexpr int64_t kSumLine = 16;  // floats of a 64-byte line: the smallest sum block

// Items per claim so that a claim covers kMinClaimBytes of weights: a contended claim costs ~0.1 us,
// as long as reading a few KiB.
int64_t min_chunk(int64_t item_bytes) { return (kMinClaimBytes + item_bytes - 1) / std::max<int64_t>(1, item_bytes); }

// Rows per item: kRows, halved while a phase would have fewer than kMinItemsPerThread items per
// thread (one Qwen3.6 expert, I = 512, is 32 gate/up items for 15 threads: the last of 3 rounds ran
// 2 items while 13 threads waited), never below min_rows: the SIMD tiers' 4-row micro-tile, or the
// AMX tier's 16-row tile when a group goes to it (smaller items would all run on AVX-512).
int64_t rows_per_item(int64_t rows, int64_t groups, int64_t k_rows, int threads, int64_t min_rows) {
  while (k_rows > min_rows && groups * ((rows + k_rows - 1) / k_rows) < kMinItemsPerThread * threads) k_rows /= 2;
  return k_rows;
}

// The fused call's sum blocks: kSumColumns, halved while the T tokens' blocks would not give every thread two, down to
// one line.
int64_t sum_columns(int64_t H, int64_t T, int threads) {
  int64_t cols = kSumColumns;
  while (cols > kSumLine && T * ((H + cols - 1) / cols) < 2 * int64_t{threads}) cols /= 2;
  return cols;
}

// y[h0:h1] += the n partial rows at parts[0..n) (offsets into base), added in that order; four rows per pass over
// y (the same additions in the same order as adding row after row into y, a quarter of y's loads and stores).
void sum_partials(float* y, const float* base, const int64_t* parts, int64_t n, int64_t h0, int64_t h1) {
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const float *p0 = base + parts[k], *p1 = base + parts[k + 1], *p2 = base + parts[k + 2], *p3 = base + parts[k + 3];
    for (int64_t h = h0; h < h1; ++h) y[h] = (((y[h] + p0[h]) + p1[h]) + p2[h]) + p3[h];
  }
  for (; k < n; ++k) {
    const float* p = base + parts[k];
    for (int64_t h = h0; h < h1; ++h) y[h] += p[h];
  }
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// The call's activation layouts, kept across calls (fresh vectors of a few hundred KiB per call
// cost page faults); one set per calling thread. Only what a call reads is written. A call that
// grew them past kKeepBufferBytes (a prefill on the CPU: ~10 B per route and hidden unit) frees
// them when it ends.
constexpr size_t kKeepBufferBytes = size_t{64} << 20;
struct CallBuffers {
  std::vector<float> xg, act;                        // [n, H], [n, I]: f32
  std::vector<uint16_t> xg_h, act_h, xg_p, act_p;    // bf16 bits; pair64 order
  std::vector<uint32_t> xg_v, act_v_;                // B-tile layouts: [n, PH], [n, PI] dwords
  std::vector<int8_t> xg_q, act_q;                   // q15 layouts: [n, q15_bytes(H)], [n, q15_bytes(I)]
  void size(int64_t n, int64_t H, int64_t I, bool bf16, bool pair_x, bool pair_act, bool vnni, bool q15_x,
            bool q15_act) {
    grow(xg, n * H);
    grow(act, n * I);
    if (bf16) {
      grow(xg_h, n * H);
      grow(act_h, n * I);
    }
    if (pair_x) grow(xg_p, n * H);
    if (pair_act) grow(act_p, n * I);
    if (vnni) {
      grow(xg_v, n * vnni_pairs(H));
      grow(act_v_, n * vnni_pairs(I));
    }
    if (q15_x) grow(xg_q, n * q15_bytes(H));
    if (q15_act) grow(act_q, n * q15_bytes(I));
  }
  const uint32_t* act_v() const { return act_v_.data(); }
  std::vector<float> partial;  // a fused call over a transposed down: each phase-1 item's partial outputs
  // phase 1 writes the intermediate's B layout a word at a time (the kernels read it as dwords)
  uint16_t* act_v_words() { return reinterpret_cast<uint16_t*>(act_v_.data()); }
  template <class T>
  static void grow(std::vector<T>& v, int64_t n) {
    if (v.size() < static_cast<size_t>(n)) v.resize(n);
  }
  size_t bytes() const {
    return (xg.capacity() + act.capacity()) * 4 +
           (xg_h.capacity() + act_h.capacity() + xg_p.capacity() + act_p.capacity()) * 2 +
           (xg_v.capacity() + act_v_.capacity() + partial.capacity()) * 4 + xg_q.capacity() + act_q.capacity();
  }
  void trim() {
    if (bytes() > kKeepBufferBytes) *this = CallBuffers();
  }
};
CallBuffers& call_buffers() {
  thread_local CallBuffers b;
  return b;
}

std::vector<float>& scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}
std::atomic<int64_t> g_gate_up_rows{kRowsPhase1};
std::atomic<int64_t> g_down_rows{kRowsPhase2};
std::atomic<bool> g_down_sum{false};
void check_item_rows(int64_t rows, const char* what) {
  if (rows < 4 || rows > 1024 || (rows & (rows - 1)))
    throw std::invalid_argument(std::string(what) + " item rows must be a power of two in [4, 1024], got " +
                                std::to_string(rows));
}
std::mutex g_profile_mu;
ExpertCallProfile g_profile;
ExpertCallTotals g_totals;  // under g_profile_mu
}  // namespace

int64_t gate_up_item_rows() { return g_gate_up_rows.load(std::memory_order_relaxed); }
void set_gate_up_item_rows(int64_t rows) {
  check_item_rows(rows, "gate/up");
  g_gate_up_rows.store(rows, std::memory_order_relaxed);
}
int64_t down_item_rows() { return g_down_rows.load(std::memory_order_relaxed); }
bool down_sum() { return g_down_sum.load(std::memory_order_relaxed); }
void set_down_sum(bool on) { g_down_sum.store(on, std::memory_order_relaxed); }
void set_down_item_rows(int64_t rows) {
  check_item_rows(rows, "down");
  g_down_rows.store(rows, std::memory_order_relaxed);
}

ExpertCallProfile last_expert_call_profile() {
  std::lock_guard<std::mutex> lock(g_profile_mu);
  return g_profile;
}

ExpertCallTotals expert_call_totals() {
  std::lock_guard<std::mutex> lock(g_profile_mu);
  return g_totals;
}

void run_experts(WorkerPool& workers, const ExpertCall& c, Tier tier) {
  const auto t_start = std::chrono::steady_clock::now();
  const ExpertPool& pool = *c.pool;
  const int64_t H = pool.hidden(), I = pool.inter(), n = c.n_tasks;
  for (int64_t i = 0; i < n; ++i) {
    if (c.token_idx[i] < 0 || c.token_idx[i] >= c.T)
      throw std::invalid_argument("task " + std::to_string(i) + ": token index " + std::to_string(c.token_idx[i]) +
                                  " is outside [0, " + std::to_string(c.T) + ")");
    if (c.expert_ids[i] < 0 || c.expert_ids[i] >= pool.n_experts())
      throw std::invalid_argument("task " + std::to_string(i) + ": expert id " + std::to_string(c.expert_ids[i]) +
                                  " is outside the pool's [0, " + std::to_string(pool.n_experts()) + ")");
    if (c.unit_start) {
      const int64_t u = c.unit_start[i];
      if (u < 0 || u > I)
        throw std::invalid_argument("task " + std::to_string(i) + ": unit start " + std::to_string(u) +
                                    " is outside [0, " + std::to_string(I) + "]");
      if (pool.down().format == WeightFormat::kInt4 && u % 32)
        throw std::invalid_argument("task " + std::to_string(i) + ": unit start " + std::to_string(u) +
                                    " is not a multiple of 32 (an int4 group of the down matrix)");
    }
  }
  const auto unit_of = [&](int64_t task) -> int64_t { return c.unit_start ? c.unit_start[task] : 0; };
  std::fill(c.y, c.y + c.T * H, 0.f);
  if (n == 0) return;

  // Routes sorted by (expert, unit start); group g covers routes [start[g], start[g + 1]).
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return c.expert_ids[a] != c.expert_ids[b] ? c.expert_ids[a] < c.expert_ids[b] : unit_of(a) < unit_of(b);
  });
  std::vector<int64_t> start{0};
  for (int64_t r = 1; r < n; ++r)
    if (c.expert_ids[order[r]] != c.expert_ids[order[r - 1]] || unit_of(order[r]) != unit_of(order[r - 1]))
      start.push_back(r);
  start.push_back(n);
  const int64_t groups = static_cast<int64_t>(start.size()) - 1;

  const DotRowsFn dot = dot_rows_for(tier);
  // A transposed down (f32/bf16 pools only): phase 1 stores each route's intermediate times its gate weight, and a
  // call of few tokens (fused) sums the same units' down rows into a partial per phase-1 item; phase 2 then adds the
  // partials (fused) or runs the down rows by column blocks (many tokens).
  const bool down_t = pool.down_transposed();
  const AxpyRowsFn axpy = axpy_rows_for(tier);
  // Layouts of the activations a group's kernels read (kernels.h): bf16 bits in bf16 mode (f32, for the tiers and
  // tails that multiply in f32, except for q15 groups, which read none); for int4 weights on the AVX2 and AVX-512 loops
  // the q15 layout (or its q8 form) for groups of up to int4_vnni_limit() tokens, on AVX-512 the pair64 order for the
  // others; for
  // groups the AMX tier takes (kAmxMinTokens+ tokens) the B-tile layout.
  const bool int4_x = pool.gate_up().format == WeightFormat::kInt4, int4_act = pool.down().format == WeightFormat::kInt4;
  const int64_t q15_tokens = int4_vnni_limit();
  const bool q8 = int4_act_bits() == 8;  // the q8 form of the layout (opt-in, lossy)
  const auto to_q = q8 ? to_q8 : to_q15;
  const auto amx_group = [&](int64_t g) {  // (int4 groups of up to q15_tokens tokens: the VNNI loop)
    const int64_t nr = start[g + 1] - start[g];
    return c.x_bf16 && tier == Tier::kAmx && nr >= kAmxMinTokens && !(int4_x && nr <= q15_tokens);
  };
  const bool q15_tier = c.x_bf16 && reads_q15(tier), pair_tier = c.x_bf16 && reads_pair64(tier);
  const auto q15_group = [&](int64_t g) { return q15_tier && !amx_group(g) && start[g + 1] - start[g] <= q15_tokens; };
  bool any_q15 = false, any_pair = false;
  for (int64_t g = 0; g < groups; ++g) {
    any_q15 |= q15_group(g);
    any_pair |= pair_tier && !amx_group(g) && !q15_group(g);
  }
  const bool q15_x = any_q15 && int4_x, q15_act = any_q15 && int4_act;  // int4 columns come in groups of 32
  const bool pair_x = any_pair && int4_x && H % 64 == 0, pair_act = any_pair && int4_act && I % 64 == 0;
  bool any_amx = false;
  for (int64_t g = 0; g < groups && !any_amx; ++g) any_amx = amx_group(g);
  const int64_t PH = vnni_pairs(H), PI = vnni_pairs(I);
  CallBuffers& b = call_buffers();
  b.size(n, H, I, c.x_bf16, pair_x, pair_act, any_amx, q15_x, q15_act);
  std::vector<int64_t> group_of(n);
  for (int64_t g = 0; g < groups; ++g) std::fill(&group_of[start[g]], &group_of[start[g + 1]], g);

  ExpertCallProfile prof;
  prof.routes = n;
  prof.groups = groups;
  // A group reads gate/up rows [u, I) and [I + u, 2I) and down columns [u, I): the fraction (I - u) / I of
  // each expert row, exactly (int4 down windows start on a 32-column group, checked above).
  const int64_t expert_bytes = static_cast<int64_t>(pool.gate_up().expert_bytes + pool.down().expert_bytes);
  for (int64_t g = 0; g < groups; ++g) prof.weight_bytes += (I - unit_of(order[start[g]])) * expert_bytes / I;
  prof.setup_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_start).count();
  const auto record_round = [&](int k, int64_t items, RoundTiming t) {
    prof.round_us[k] = t.wall_us;
    prof.wait_us[k] = t.wait_us;
    prof.items[k] = items;
  };
  // The layouts, in route order, in parallel (serially they cost more than the products of an
  // 8-token int4 call spread over 15 threads: bench/RESULTS.md session 15). Items [0, n): a
  // route's copies (and its pair64 order); then, per AMX group, blocks of
  // kVnniColumns columns of its B-tile layout, packed by one thread for all of the group's tokens
  // straight from x (one item per route instead wrote interleaved dwords of the same lines from
  // several threads: 86 us of 1.26 ms in a bf16 8 x 8 call on the H200 host).
  // A route alone on its expert (outside the AMX tiles) reads its token's copies from the first such route of that
  // token (src_of), which alone builds them: batch-1 decode builds one layout for all its experts.
  std::vector<int64_t> src_of(n), builds, solo_of_token(c.T, -1);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t g = group_of[r];
    src_of[r] = r;
    if (start[g + 1] - start[g] == 1 && !amx_group(g)) {
      int64_t& first = solo_of_token[c.token_idx[order[r]]];
      if (first >= 0) {
        src_of[r] = first;
        continue;
      }
      first = r;
    }
    builds.push_back(r);
  }
  const int64_t nb = static_cast<int64_t>(builds.size());
  std::vector<int64_t> vnni_first{nb};  // per group: its first vnni item (AMX groups only have some)
  for (int64_t g = 0; g < groups; ++g)
    vnni_first.push_back(vnni_first.back() + (amx_group(g) ? (H + kVnniColumns - 1) / kVnniColumns : 0));
  const int64_t layout_items = vnni_first.back();
  const RoundTiming t_layouts = workers.parallel_for(layout_items, [&](int64_t item, int) {
    if (item >= nb) {
      const int64_t g = std::upper_bound(vnni_first.begin(), vnni_first.end(), item) - vnni_first.begin() - 1;
      const int64_t r0 = start[g], nr = start[g + 1] - r0, k0 = (item - vnni_first[g]) * kVnniColumns;
      for (int64_t j = 0; j < nr; ++j)
        pack_vnni(static_cast<const uint16_t*>(c.x) + c.token_idx[order[r0 + j]] * H, H, k0, k0 + kVnniColumns,
                  static_cast<int>(nr), static_cast<int>(j), &b.xg_v[r0 * PH], int4_x);
      return;
    }
    const int64_t r = builds[item], t = c.token_idx[order[r]], g = group_of[r], r0 = start[g], nr = start[g + 1] - r0;
    float* xf = &b.xg[r * H];
    if (!c.x_bf16) {
      std::memcpy(xf, static_cast<const float*>(c.x) + t * H, H * 4);
      return;
    }
    const uint16_t* src = static_cast<const uint16_t*>(c.x) + t * H;
    uint16_t* xh = &b.xg_h[r * H];
    std::memcpy(xh, src, H * 2);
    const bool q15_g = q15_x && q15_group(g);
    if (!q15_g)  // (the q15 loop reads no f32 copy: int4 rows leave no tail)
      for (int64_t h = 0; h < H; ++h) xf[h] = bf16_to_f32(xh[h]);
    if (amx_group(g) && !down_t) {
      // the intermediate's pad positions [I, 2 PI) of this route stay zero (phase 1 writes [u, I))
      uint16_t* av = b.act_v_words() + 2 * r0 * PI;
      for (int64_t pos = I; pos < 2 * PI; ++pos) av[2 * ((pos / 2) * nr + (r - r0)) + (pos & 1)] = 0;
    } else if (q15_g) {
      to_q(xh, 0, H, &b.xg_q[r * q15_bytes(H)], H / 2);
    } else if (pair_x) {
      to_pair64(xh, H, &b.xg_p[r * H]);
    }
  }, layout_items <= 2 ? layout_items : 1);  // one or two layouts (decode at batch 1): the caller alone, no wake-up
  record_round(0, layout_items, t_layouts);

  // Phase 1: act[r, i] = silu(gate_e[i] . x_r) * (up_e[i] . x_r), items = (group, block of i).
  // (the q15 layout of the intermediate is written a lane of 8 at a time: items of 8+ rows)
  const int64_t min_rows = any_amx ? 16 : q15_act ? 8 : 4;
  const int64_t rows1 = rows_per_item(I, groups, std::max(gate_up_item_rows(), min_rows), workers.n_threads(), min_rows);
  const int64_t blocks1 = (I + rows1 - 1) / rows1;
  // Phase 1's item: group item / blocks1, its units [i0, i1) (empty below the group's unit start).
  const auto item_units = [&](int64_t item) -> std::pair<int64_t, int64_t> {
    const int64_t k = item % blocks1;
    return {std::max(k * rows1, unit_of(order[start[item / blocks1]])), std::min(I, (k + 1) * rows1)};
  };
  // The fused form (a transposed down, few tokens): item k's partial [nr, H] at part_off[k] (-1: an item with no units
  // of its group), and per token t the offsets of its partial rows in item order, tok_parts[tok_start[t], ..).
  std::vector<int64_t> part_off, tok_start, tok_parts;
  bool fused = false;
  if (down_t) {
    int64_t total = 0;
    part_off.assign(groups * blocks1, -1);
    for (int64_t item = 0; item < groups * blocks1; ++item) {
      const auto [i0, i1] = item_units(item);
      if (i0 >= i1) continue;
      const int64_t g = item / blocks1;
      part_off[item] = total;
      total += (start[g + 1] - start[g]) * H;
    }
    fused = total <= kFusedPartialFloats;
    if (fused) {
      CallBuffers::grow(b.partial, total);
      tok_start.assign(c.T + 1, 0);
      for (int pass = 0; pass < 2; ++pass) {  // count, then place (in item order)
        std::vector<int64_t> at(tok_start.begin(), tok_start.end() - 1);
        if (pass) tok_parts.resize(tok_start.back());
        for (int64_t item = 0; item < groups * blocks1; ++item) {
          if (part_off[item] < 0) continue;
          const int64_t g = item / blocks1;
          for (int64_t r = start[g]; r < start[g + 1]; ++r) {
            const int64_t t = c.token_idx[order[r]];
            if (pass) tok_parts[at[t]++] = part_off[item] + (r - start[g]) * H;
            else ++tok_start[t + 1];
          }
        }
        if (!pass) std::partial_sum(tok_start.begin(), tok_start.end(), tok_start.begin());
      }
    }
  }
  // 2 rows1 of gate/up's 2I rows (and rows1 of a transposed down's I rows, read in the same item when fused)
  const int64_t item1_bytes =
      rows1 * static_cast<int64_t>(pool.gate_up().expert_bytes + (fused ? pool.down().expert_bytes : 0)) / I;
  const RoundTiming t_phase1 = workers.parallel_for(groups * blocks1, [&](int64_t item, int) {
    const int64_t g = item / blocks1, r0 = start[g], nr = start[g + 1] - r0;
    const auto [i0, i1] = item_units(item);  // the group's units only
    if (i0 >= i1) return;
    const MatrixRef w = matrix_of(pool.gate_up(), c.expert_ids[order[r0]]);
    const bool vnni_act = amx_group(g), q15_g = q15_group(g);
    const int64_t s0 = src_of[r0];  // where the group's copies are (r0, or an earlier route of a lone token)
    const ActRef a{q15_x && q15_g ? nullptr : &b.xg[s0 * H], c.x_bf16 ? &b.xg_h[s0 * H] : nullptr, H,
                   static_cast<int>(nr),
                   pair_x && !vnni_act && !q15_g ? &b.xg_p[s0 * H] : nullptr, vnni_act ? &b.xg_v[r0 * PH] : nullptr,
                   q15_x && q15_g ? &b.xg_q[s0 * q15_bytes(H)] : nullptr, H / 2, q8};
    uint16_t* act_v = vnni_act && !down_t ? b.act_v_words() + 2 * r0 * PI : nullptr;
    std::vector<float>& buf = scratch(2 * rows1 * nr);
    float* gate = buf.data();
    float* up = buf.data() + rows1 * nr;
    dot(w, i0, i1, a, gate);
    dot(w, I + i0, I + i1, a, up);
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t j = 0; j < nr; ++j) {
        float v = silu(gate[(i - i0) * nr + j]) * up[(i - i0) * nr + j];
        if (c.x_bf16) {
          const uint16_t h = f32_to_bf16(v);
          v = bf16_to_f32(h);
          if (!down_t) {  // (the axpy pass reads only the f32 intermediate)
            b.act_h[(r0 + j) * I + i] = h;
            if (act_v) {  // one word of the pair dword: items never write the same word
              const int64_t pos = int4_act ? amx_int4_position(i) : i;
              act_v[2 * ((pos / 2) * nr + j) + (pos & 1)] = h;
            } else if (pair_act && !q15_g) {
              b.act_p[(r0 + j) * I + pair64_index(i)] = h;
            }
          }
        }
        b.act[(r0 + j) * I + i] = down_t ? c.weights[order[r0 + j]] * v : v;
      }
    }
    if (fused) {  // the same units' down rows into this item's partial, while they are warm in its core's caches
      float* part = b.partial.data() + part_off[item];
      std::fill(part, part + nr * H, 0.f);
      thread_local std::vector<const float*> coef;
      thread_local std::vector<float*> outs;
      coef.resize(nr);
      outs.resize(nr);
      for (int64_t j = 0; j < nr; ++j) {
        coef[j] = &b.act[(r0 + j) * I];
        outs[j] = part + j * H;
      }
      axpy(matrix_of(pool.down(), c.expert_ids[order[r0]]), i0, i1, coef.data(), static_cast<int>(nr), 0, H,
           outs.data());
    }
    if (q15_act && q15_g)  // [i0, i1): whole lanes (multiples of 8: the unit start is one of 32)
      for (int64_t j = 0; j < nr; ++j) to_q(&b.act_h[(r0 + j) * I], i0, i1, &b.act_q[(r0 + j) * q15_bytes(I)], I / 2);
  }, min_chunk(item1_bytes));
  record_round(1, groups * blocks1, t_phase1);
  prof.rows1 = rows1;

  if (down_t) {  // a transposed down (DownLayout::kIH): each group's units [u, I) are whole rows
    int64_t items2 = 0, cols2 = 0;
    RoundTiming t_phase2;
    if (fused) {  // phase 1 summed the rows per item: y[t] = the sum of t's partial rows in item order, by column blocks
      cols2 = sum_columns(H, c.T, workers.n_threads());
      const int64_t per_token = (H + cols2 - 1) / cols2;
      items2 = c.T * per_token;
      t_phase2 = workers.parallel_for(items2, [&](int64_t item, int) {
        const int64_t t = item / per_token, h0 = (item % per_token) * cols2, h1 = std::min(H, h0 + cols2);
        sum_partials(c.y + t * H, b.partial.data(), &tok_parts[tok_start[t]], tok_start[t + 1] - tok_start[t], h0, h1);
      });
    } else {  // y[t, h0:h1] += sum over the groups of t's routes of c_r[i] * down_e[i, h0:h1], i in [u, I)
      cols2 = rows_per_item(H, 1, kAxpyColumns, workers.n_threads(), kMinAxpyColumns);
      items2 = (H + cols2 - 1) / cols2;
      const int64_t item2_bytes = groups * cols2 * static_cast<int64_t>(pool.down().expert_bytes) / H;
      // the kernel's vectors must not alias: a group with a token routed twice to its expert goes route by route
      std::vector<char> distinct_tokens(groups, 1);
      for (int64_t g = 0; g < groups; ++g) {
        if (start[g + 1] - start[g] == 1) continue;
        std::vector<int32_t> toks;
        for (int64_t r = start[g]; r < start[g + 1]; ++r) toks.push_back(c.token_idx[order[r]]);
        std::sort(toks.begin(), toks.end());
        distinct_tokens[g] = std::adjacent_find(toks.begin(), toks.end()) == toks.end();
      }
      t_phase2 = workers.parallel_for(items2, [&](int64_t item, int) {
        const int64_t h0 = item * cols2, h1 = std::min(H, h0 + cols2);
        thread_local std::vector<const float*> coef;
        thread_local std::vector<float*> outs;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r0 = start[g], nr = start[g + 1] - r0, u = unit_of(order[r0]);
          if (u == I) continue;
          coef.resize(nr);
          outs.resize(nr);
          for (int64_t j = 0; j < nr; ++j) {
            coef[j] = &b.act[(r0 + j) * I];
            outs[j] = c.y + c.token_idx[order[r0 + j]] * H;
          }
          const MatrixRef w = matrix_of(pool.down(), c.expert_ids[order[r0]]);
          if (distinct_tokens[g]) {
            axpy(w, u, I, coef.data(), static_cast<int>(nr), h0, h1, outs.data());
          } else {
            for (int64_t j = 0; j < nr; ++j) axpy(w, u, I, coef.data() + j, 1, h0, h1, outs.data() + j);
          }
        }
      }, min_chunk(item2_bytes));
    }
    record_round(2, items2, t_phase2);
    prof.rows2 = cols2;
  } else {
    // Phase 2: y[t, h] += w_r * (down_e[h] . act_r); an item owns output rows [h0, h1) of every
    // token, so no two threads write the same element.
    const int64_t rows2 = rows_per_item(H, 1, std::max(down_item_rows(), min_rows), workers.n_threads(), min_rows);
    const int64_t blocks2 = (H + rows2 - 1) / rows2;
    const int64_t item2_bytes = groups * rows2 * static_cast<int64_t>(pool.down().expert_bytes) / H;  // of each down
    // The down columns of group g's units and their activations' layouts.
    const auto down_of = [&](int64_t g) -> std::pair<MatrixRef, ActRef> {
      const int64_t r0 = start[g], nr = start[g + 1] - r0, u = unit_of(order[r0]);
      // pair64 spans stay aligned only from a multiple of 64; the B layout of the window [u, I) from pair u / 2 on:
      // whole 32-column steps only when u % 32 == 0
      const bool vnni_act = amx_group(g), q15_g = q15_group(g);
      return {column_window(matrix_of(pool.down(), c.expert_ids[order[r0]]), u, I - u),
              ActRef{&b.act[r0 * I + u], c.x_bf16 ? &b.act_h[r0 * I + u] : nullptr, I, static_cast<int>(nr),
                     pair_act && !vnni_act && !q15_g && u % 64 == 0 ? &b.act_p[r0 * I + u] : nullptr,
                     vnni_act && u % 32 == 0 ? b.act_v() + r0 * PI + u / 2 * nr : nullptr,
                     q15_act && q15_g ? &b.act_q[r0 * q15_bytes(I) + u / 2] : nullptr, I / 2, q8}};
    };
    // down_sum: the groups of one route (outside the AMX tiles) sum their rows per token in one pass (dot_rows_sum);
    // sums[s0, s1) = such groups of one token, in group order (batch-1 decode: every expert of the call, one pass).
    std::vector<int64_t> sums, sum_start{0};
    if (down_sum() && tier >= Tier::kAvx512Bf16) {
      for (int64_t g = 0; g < groups; ++g)
        if (start[g + 1] - start[g] == 1 && !amx_group(g) && unit_of(order[start[g]]) < I) sums.push_back(g);
      std::stable_sort(sums.begin(), sums.end(), [&](int64_t a, int64_t b2) {
        return c.token_idx[order[start[a]]] < c.token_idx[order[start[b2]]];
      });
      for (size_t i = 1; i <= sums.size(); ++i)
        if (i == sums.size() || c.token_idx[order[start[sums[i]]]] != c.token_idx[order[start[sums[i - 1]]]])
          sum_start.push_back(static_cast<int64_t>(i));
    }
    std::vector<char> summed(groups, 0);
    for (int64_t g : sums) summed[g] = 1;
    const RoundTiming t_phase2 = workers.parallel_for(blocks2, [&](int64_t item, int) {
      const int64_t h0 = item * rows2, h1 = std::min(H, h0 + rows2);
      for (size_t p = 0; p + 1 < sum_start.size(); ++p) {
        thread_local std::vector<MatrixRef> ws;
        thread_local std::vector<ActRef> as;
        thread_local std::vector<float> wts;
        ws.clear();
        as.clear();
        wts.clear();
        for (int64_t i = sum_start[p]; i < sum_start[p + 1]; ++i) {
          const auto [w, a] = down_of(sums[i]);
          ws.push_back(w);
          as.push_back(a);
          wts.push_back(c.weights[order[start[sums[i]]]]);
        }
        float* out = scratch(rows2).data();
        dot_rows_sum(ws.data(), as.data(), wts.data(), static_cast<int>(ws.size()), h0, h1, out);
        float* yt = c.y + c.token_idx[order[start[sums[sum_start[p]]]]] * H;
        for (int64_t h = h0; h < h1; ++h) yt[h] += out[h - h0];
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = start[g], nr = start[g + 1] - r0, u = unit_of(order[r0]);
        if (u == I || summed[g]) continue;  // no unit of this expert here, or summed above
        const auto [w, a] = down_of(g);
        float* out = scratch(rows2 * nr).data();
        dot(w, h0, h1, a, out);
        for (int64_t j = 0; j < nr; ++j) {
          const int64_t task = order[r0 + j];
          float* yt = c.y + c.token_idx[task] * H;
          const float wt = c.weights[task];
          for (int64_t h = h0; h < h1; ++h) yt[h] += wt * out[(h - h0) * nr + j];
        }
      }
    }, min_chunk(item2_bytes));
    record_round(2, blocks2, t_phase2);
    prof.rows2 = rows2;
  }
  b.trim();
  prof.total_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_start).count();
  std::lock_guard<std::mutex> lock(g_profile_mu);
  g_profile = prof;
  g_totals.calls += 1;
  g_totals.weight_bytes += prof.weight_bytes;
  g_totals.total_us += prof.total_us;
  g_totals.setup_us += prof.setup_us;
  for (int k = 0; k < 3; ++k) {
    g_totals.round_us[k] += prof.round_us[k];
    g_totals.wait_us[k] += prof.wait_us[k];
  }
}

}  // namespace ftjax
