// Persistent worker pool: one thread per physical core minus two (the caller coordinates and
// works too; one core stays free for the JAX dispatch thread: on the H200 host, 15 workers + the
// coordinator + dispatch on 16 cores gave millisecond stalls whenever a pinned worker was
// descheduled), each pinned; wake-up spins briefly then sleeps. Beside a GPU the Python side
// raises the spin to 2 ms (longer than the gap between the MoE layers of a decode step), so the
// calls of a step cost a cache-line handoff, not a futex; on a CPU-only host a long spin would
// take the cores from XLA's own threads between expert calls.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ftjax {

struct WorkerConfig {
  int n_workers = -1;   // threads besides the caller; -1 = physical cores - 2 (at least 0)
  int spin_us = 100;    // busy-wait this long for new work before sleeping
  bool pin = true;      // pin worker i to the first logical CPU of physical core i + 1
  bool every_cpu = false;  // pin over every logical CPU this process may run on instead (SMT siblings too)
};

// Logical CPUs this process may run on, one per physical core (SMT siblings dropped).
std::vector<int> physical_core_cpus();
// Every logical CPU this process may run on.
std::vector<int> allowed_cpus();

// A parallel_for's wall time and how long its caller waited for the other threads after running out
// of items to claim (stragglers, late wake-ups), in microseconds: call profiles read them.
struct RoundTiming {
  double wall_us = 0, wait_us = 0;
};

class WorkerPool {
 public:
  explicit WorkerPool(const WorkerConfig& cfg);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // fn(item, thread) for every item in [0, n_items) on the workers and the calling thread;
  // thread is in [0, n_threads()). Returns when all items ran; rethrows the first exception.
  // Calls are serialised: one job at a time. A thread claims at least min_chunk items at once (for
  // items so small that a contended claim would cost more than the item).
  RoundTiming parallel_for(int64_t n_items, const std::function<void(int64_t, int)>& fn, int64_t min_chunk = 1);
  int n_threads() const { return static_cast<int>(threads_.size()) + 1; }
  const WorkerConfig& config() const { return cfg_; }
  const std::vector<int>& pinned_cpus() const { return cpus_; }

 private:
  void worker_main(int index);
  void run_round(int64_t n_items, const std::function<void(int64_t, int)>& fn, int64_t min_chunk, RoundTiming& t);
  void run_items(int thread);
  void close_round();

  WorkerConfig cfg_;
  std::vector<int> cpus_;
  std::vector<std::thread> threads_;
  std::mutex call_mu_;  // serialises parallel_for callers

  // The current round of items. ticket_ packs (round 16 bits | n_items 24 | next item 24); a thread
  // claims a chunk of items by advancing it with a CAS, so a claim always names items of the round
  // that fn_ belongs to, and a worker that wakes late (asleep, or descheduled by another thread on its
  // core) finds the items taken and nobody waits for it: the caller waits for items, not workers.
  // Chunks (n_items / (8 n_threads): ~8 claims per thread, shrinking to the caller's min_chunk as
  // the items run out, so the last claims are short) and one cache line per hot atomic, so 15 threads do not
  // queue on one line per item (on the H200 host this did not shorten a tiny expert call: ~33 us
  // stays, cause not found yet; bench/RESULTS.md session 4). generation_ only wakes the workers.
  std::atomic<const std::function<void(int64_t, int)>*> fn_{nullptr};
  std::atomic<int64_t> chunk_{1}, min_chunk_{1};
  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<int64_t> items_done_{0};
  alignas(64) std::atomic<uint64_t> generation_{0};
  uint64_t round_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex err_mu_;
  std::string error_;
  bool failed_ = false;

  std::mutex sleep_mu_;
  std::condition_variable wake_cv_;
  std::atomic<int> sleepers_{0};
};

// Test hook: `rounds` parallel_for calls of random sizes up to `max_items` (one with more items than
// a ticket holds when `big`), each checking every item ran exactly once on a valid thread index, then
// a call whose item throws (must surface as an exception) and a clean call after it. Returns the
// number of anomalies (0 = correct).
int64_t worker_self_test(WorkerPool& pool, int rounds, int64_t max_items, uint64_t seed, bool big);

// The process-wide pool used by the FFI handlers, created on first use with the default config.
WorkerPool& global_workers();
void configure_global_workers(const WorkerConfig& cfg);  // replaces the pool (no call may be running)

}  // namespace ftjax
