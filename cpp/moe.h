// The CPU expert computation of one MoE layer over a task list:
//   y[t] = sum over tasks (t, e, w) of w * down_e(silu(gate_e(x[t])) * up_e(x[t]))
// (or the sum over the units [u, I) of the expert's intermediate only, per task: unit_start)
// Tasks are grouped by expert so each expert's weights are read once per call, however many
// tokens route to it; both phases split the work across threads by output rows.
#pragma once
#include <cstdint>

#include "kernels.h"
#include "pool.h"
#include "workers.h"

namespace ftjax {

struct ExpertCall {
  const ExpertPool* pool;
  const void* x;       // [T, H], f32 or bf16 bits
  bool x_bf16;         // bf16 activations: the SwiGLU intermediate is rounded to bf16 as well
  int64_t T;
  const int32_t* token_idx;   // [n_tasks], in [0, T)
  const int32_t* expert_ids;  // [n_tasks], flat ids in [0, pool->n_experts())
  const float* weights;       // [n_tasks]
  int64_t n_tasks;            // the valid prefix of the task arrays
  float* y;                   // [T, H], overwritten
  // [n_tasks] or nullptr (all 0): the task computes only the expert's intermediate units [u, I),
  // i.e. gate/up rows u.. and down columns u.. (the other units' share of the sum is computed
  // elsewhere, e.g. on the GPU from a partial fill). int4 pools need u % 32 == 0.
  const int32_t* unit_start = nullptr;
};

// Throws std::invalid_argument naming the bad task (index and value) before touching y.
void run_experts(WorkerPool& workers, const ExpertCall& call, Tier tier);

// Rows per work item before the halving for balance (a power of two in [4, 1024]; only speed depends on
// them): gate rows (and as many up rows) of gate/up's round (default 16), output rows of down's (32).
int64_t gate_up_item_rows();
void set_gate_up_item_rows(int64_t rows);
int64_t down_item_rows();
void set_down_item_rows(int64_t rows);
// Whether down's round sums a token's lone experts (groups of one route, outside the AMX tiles) in one pass per work
// item (dot_rows_sum, AVX-512 tiers) instead of one dot_rows call, reduction and store per expert. The sums' order
// differs: results agree within f32 rounding, not bit for bit. Off by default: on the H200 host (bench/RESULTS.md
// session 28, round robin) the b1 decode step ran 2.1% faster with it (down round 36.1 against 37.2 us), within the
// step's noise, while the standalone 1 x 8 calls' down round ran from 4% faster (Qwen3.6 int4) to 7-16% slower
// (Qwen3.6 bf16, large int4): 8 experts' rows interleaved per tile instead of one expert's 32 rows after another.
bool down_sum();
void set_down_sum(bool on);

// Where the last run_experts call (any thread) spent its time, in microseconds: the whole call, the
// work before the first round (checks, sort), and per round (activation layouts, phase 1 = gate/up,
// phase 2 = down) its wall time and the caller's wait for the other threads after its last item.
struct ExpertCallProfile {
  double total_us = 0, setup_us = 0;
  double round_us[3] = {}, wait_us[3] = {};  // layouts, phase 1, phase 2
  int64_t routes = 0, groups = 0, items[3] = {}, rows1 = 0, rows2 = 0;
  int64_t weight_bytes = 0;  // the experts' weight bytes the call read: each group's units [u, I) once
};
ExpertCallProfile last_expert_call_profile();

// Every run_experts call with tasks since start-up (any thread): how many, and the weight bytes they
// read (ExpertCallProfile::weight_bytes summed): what an effective GB/s over a run divides.
struct ExpertCallTotals {
  int64_t calls = 0, weight_bytes = 0;
  // the calls' ExpertCallProfile times summed (us): whole call, setup, per round wall and the caller's wait
  double total_us = 0, setup_us = 0, round_us[3] = {}, wait_us[3] = {};
};
ExpertCallTotals expert_call_totals();

}  // namespace ftjax
