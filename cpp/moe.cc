#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace ftjax {
namespace {
constexpr int64_t kRowsPhase1 = 16;  // gate rows (and as many up rows) per work item
constexpr int64_t kRowsPhase2 = 16;  // output rows of down per work item
constexpr int64_t kMinItemsPerThread = 4;  // below it, items of half the rows (load balance)
constexpr int64_t kMinClaimBytes = 32 << 10;  // weight bytes a thread claims at once, at least

// Items per claim so that a claim covers kMinClaimBytes of weights: a contended claim costs ~0.1 us,
// as long as reading a few KiB.
int64_t min_chunk(int64_t item_bytes) { return (kMinClaimBytes + item_bytes - 1) / std::max<int64_t>(1, item_bytes); }

// Rows per item: kRows, halved while a phase would have fewer than kMinItemsPerThread items per
// thread (one Qwen3.6 expert, I = 512, is 32 gate/up items for 15 threads: the last of 3 rounds ran
// 2 items while 13 threads waited), never below the SIMD tiers' 4-row micro-tile.
int64_t rows_per_item(int64_t rows, int64_t groups, int64_t k_rows, int threads) {
  while (k_rows > 4 && groups * ((rows + k_rows - 1) / k_rows) < kMinItemsPerThread * threads) k_rows /= 2;
  return k_rows;
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

std::vector<float>& scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}
}  // namespace

void run_experts(WorkerPool& workers, const ExpertCall& c, Tier tier) {
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

  // Activations gathered in route order: f32 always, bf16 bits too in bf16 mode.
  std::vector<float> xg(n * H), act(n * I);
  std::vector<uint16_t> xg_h, act_h;
  if (c.x_bf16) {
    xg_h.resize(n * H);
    act_h.resize(n * I);
  }
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = c.token_idx[order[r]];
    if (c.x_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(c.x) + t * H;
      std::memcpy(&xg_h[r * H], src, H * 2);
      for (int64_t h = 0; h < H; ++h) xg[r * H + h] = bf16_to_f32(src[h]);
    } else {
      std::memcpy(&xg[r * H], static_cast<const float*>(c.x) + t * H, H * 4);
    }
  }
  const DotRowsFn dot = dot_rows_for(tier);
  // int4 weights with bf16 activations: the activations also in pair64 order (kernels.h).
  const bool pair_x = c.x_bf16 && pool.gate_up().format == WeightFormat::kInt4 && H % 64 == 0;
  const bool pair_act = c.x_bf16 && pool.down().format == WeightFormat::kInt4 && I % 64 == 0;
  std::vector<uint16_t> xg_p, act_p;
  if (pair_x) {
    xg_p.resize(n * H);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < H; ++h) xg_p[r * H + pair64_index(h)] = xg_h[r * H + h];
  }
  if (pair_act) act_p.resize(n * I);
  // AMX tier, groups of kAmxMinTokens or more: their activations in the B-tile layout (pack_vnni),
  // once per call; a group's block starts at its first route r0: r0 * vnni_pairs(K) dwords. (Decode
  // calls of one token per expert skip all of it.)
  const bool int4_x = pool.gate_up().format == WeightFormat::kInt4, int4_act = pool.down().format == WeightFormat::kInt4;
  const auto amx_group = [&](int64_t g) {
    return c.x_bf16 && tier == Tier::kAmx && start[g + 1] - start[g] >= kAmxMinTokens;
  };
  bool vnni = false;
  for (int64_t g = 0; g < groups && !vnni; ++g) vnni = amx_group(g);
  const int64_t PH = vnni_pairs(H), PI = vnni_pairs(I);
  std::vector<uint32_t> xg_v, act_v;
  if (vnni) {
    xg_v.resize(n * PH);
    act_v.resize(n * PI);  // zero: pairs past I stay zero
    workers.parallel_for(groups, [&](int64_t g, int) {
      if (amx_group(g))
        pack_vnni(&xg_h[start[g] * H], H, static_cast<int>(start[g + 1] - start[g]), H, &xg_v[start[g] * PH], int4_x);
    }, 1);
  }

  // Phase 1: act[r, i] = silu(gate_e[i] . x_r) * (up_e[i] . x_r), items = (group, block of i).
  const int64_t rows1 = rows_per_item(I, groups, kRowsPhase1, workers.n_threads());
  const int64_t blocks1 = (I + rows1 - 1) / rows1;
  const int64_t item1_bytes = rows1 * static_cast<int64_t>(pool.gate_up().expert_bytes) / I;  // 2 rows1 of 2I rows
  workers.parallel_for(groups * blocks1, [&](int64_t item, int) {
    const int64_t g = item / blocks1, r0 = start[g], nr = start[g + 1] - r0;
    const int64_t i1 = std::min(I, (item % blocks1 + 1) * rows1);
    const int64_t i0 = std::max((item % blocks1) * rows1, unit_of(order[r0]));  // the group's units only
    if (i0 >= i1) return;
    const MatrixRef w = matrix_of(pool.gate_up(), c.expert_ids[order[r0]]);
    const ActRef a{&xg[r0 * H], c.x_bf16 ? &xg_h[r0 * H] : nullptr, H, static_cast<int>(nr),
                   pair_x ? &xg_p[r0 * H] : nullptr, amx_group(g) ? &xg_v[r0 * PH] : nullptr};
    const bool vnni_act = amx_group(g);
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
          act_h[(r0 + j) * I + i] = h;
          if (pair_act) act_p[(r0 + j) * I + pair64_index(i)] = h;
          if (vnni_act) {
            const int64_t pos = int4_act ? amx_int4_position(i) : i;
            act_v[r0 * PI + (pos / 2) * nr + j] |= static_cast<uint32_t>(h) << (16 * (pos & 1));
          }
          v = bf16_to_f32(h);
        }
        act[(r0 + j) * I + i] = v;
      }
    }
  }, min_chunk(item1_bytes));

  // Phase 2: y[t, h] += w_r * (down_e[h] . act_r); an item owns output rows [h0, h1) of every
  // token, so no two threads write the same element.
  const int64_t rows2 = rows_per_item(H, 1, kRowsPhase2, workers.n_threads());
  const int64_t blocks2 = (H + rows2 - 1) / rows2;
  const int64_t item2_bytes = groups * rows2 * static_cast<int64_t>(pool.down().expert_bytes) / H;  // of each down
  workers.parallel_for(blocks2, [&](int64_t item, int) {
    const int64_t h0 = item * rows2, h1 = std::min(H, h0 + rows2);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = start[g], nr = start[g + 1] - r0, u = unit_of(order[r0]);
      if (u == I) continue;  // no unit of this expert here
      // the down columns of the group's units; pair64 spans stay aligned only from a multiple of 64
      const MatrixRef w = column_window(matrix_of(pool.down(), c.expert_ids[order[r0]]), u, I - u);
      // the B layout of the window [u, I) from pair u / 2 on: whole 32-column steps only when u % 32 == 0
      const ActRef a{&act[r0 * I + u], c.x_bf16 ? &act_h[r0 * I + u] : nullptr, I, static_cast<int>(nr),
                     pair_act && u % 64 == 0 ? &act_p[r0 * I + u] : nullptr,
                     amx_group(g) && u % 32 == 0 ? &act_v[r0 * PI + u / 2 * nr] : nullptr};
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
}

}  // namespace ftjax
