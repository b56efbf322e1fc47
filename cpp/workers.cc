#include "workers.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#define FTJAX_PAUSE() _mm_pause()
#else
#define FTJAX_PAUSE() std::this_thread::yield()
#endif

namespace ftjax {
namespace {
int read_int(const std::string& path, int fallback) {
  std::ifstream f(path);
  int v;
  return (f >> v) ? v : fallback;
}
}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

std::vector<int> physical_core_cpus() {
  std::vector<int> cpus;
  std::map<std::pair<int, int>, int> first_of_core;  // (package, core) -> first logical CPU
  for (int c : allowed_cpus()) {
    const std::string topo = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    const auto key = std::make_pair(read_int(topo + "physical_package_id", 0), read_int(topo + "core_id", c));
    first_of_core.emplace(key, c);
  }
  for (auto& kv : first_of_core) cpus.push_back(kv.second);
  std::sort(cpus.begin(), cpus.end());
  return cpus;
}

WorkerPool::WorkerPool(const WorkerConfig& cfg) : cfg_(cfg) {
  const auto cores = cfg.every_cpu ? allowed_cpus() : physical_core_cpus();
  int n = cfg.n_workers;
  if (n < 0) n = std::max(0, static_cast<int>(cores.size()) - 2);
  if (n > 1024) throw std::invalid_argument("n_workers " + std::to_string(n) + " is too large (max 1024)");
  cfg_.n_workers = n;
  // Core 0 of the list stays with the caller (the coordinator); workers take the rest, wrapping.
  // cpus_ is complete before any thread starts: workers read it.
  if (cfg.pin && cores.size() > 1)
    for (int i = 0; i < n; ++i) cpus_.push_back(cores[(i + 1) % cores.size()]);
  for (int i = 0; i < n; ++i) {
    threads_.emplace_back(&WorkerPool::worker_main, this, i);
    // A name per worker ("ftjax-w<i>", at most 15 characters), set before the pool is handed out, lets
    // /proc/self/task tell the pool's CPU time from the runtime's other threads (bench/thread_cpu.py).
    pthread_setname_np(threads_.back().native_handle(), ("ftjax-w" + std::to_string(i)).substr(0, 15).c_str());
  }
}

WorkerPool::~WorkerPool() {
  stop_.store(true);
  generation_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(sleep_mu_);
  }
  wake_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

namespace {
constexpr int kFieldBits = 24;
constexpr uint64_t kFieldMask = (1ull << kFieldBits) - 1;
constexpr int64_t kMaxRoundItems = static_cast<int64_t>(kFieldMask);
uint64_t pack_ticket(uint64_t round, uint64_t n, uint64_t next) {
  return ((round & 0xffff) << (2 * kFieldBits)) | (n << kFieldBits) | next;
}
uint64_t ticket_n(uint64_t t) { return (t >> kFieldBits) & kFieldMask; }
uint64_t ticket_next(uint64_t t) { return t & kFieldMask; }
}  // namespace

void WorkerPool::run_items(int thread) {
  for (;;) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    uint64_t take;
    do {
      if (ticket_next(t) >= ticket_n(t)) return;
      // chunk_ / min_chunk_ were stored before the ticket of their round; a stale t fails the CAS
      // below. Guided: claims shrink with what is left (down to min_chunk_), so the round's last
      // claims are short and the threads finish together.
      const uint64_t left = ticket_n(t) - ticket_next(t);
      const uint64_t guided = std::max<uint64_t>(left / (2 * static_cast<uint64_t>(n_threads())),
                                                 static_cast<uint64_t>(min_chunk_.load(std::memory_order_relaxed)));
      take = std::min<uint64_t>({static_cast<uint64_t>(chunk_.load(std::memory_order_relaxed)), guided, left});
    } while (!ticket_.compare_exchange_weak(t, t + take, std::memory_order_acq_rel, std::memory_order_acquire));
    const int64_t first = static_cast<int64_t>(ticket_next(t));
    try {
      const auto& fn = *fn_.load(std::memory_order_relaxed);  // ordered by the acquire CAS above
      for (int64_t item = first; item < first + static_cast<int64_t>(take); ++item) fn(item, thread);
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(err_mu_);
        if (!failed_) error_ = e.what();
        failed_ = true;
      }
      close_round();
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(err_mu_);
        if (!failed_) error_ = "unknown exception in a worker";
        failed_ = true;
      }
      close_round();
    }
    items_done_.fetch_add(static_cast<int64_t>(take), std::memory_order_acq_rel);
  }
}

void WorkerPool::close_round() {
  // Stop handing out items; the ones never handed out count as done.
  uint64_t t = ticket_.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t n = ticket_n(t), next = ticket_next(t);
    if (next >= n) return;
    if (ticket_.compare_exchange_weak(t, (t & ~kFieldMask) | n, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      items_done_.fetch_add(static_cast<int64_t>(n - next), std::memory_order_acq_rel);
      return;
    }
  }
}

void WorkerPool::worker_main(int index) {
  if (!cpus_.empty() && cpus_[index] < CPU_SETSIZE) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus_[index], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort (containers may refuse)
  }
  uint64_t seen = 0;
  for (;;) {
    // Spin for new work, then sleep on the condition variable.
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(cfg_.spin_us);
    uint64_t gen;
    int polls = 0;
    while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
      FTJAX_PAUSE();
      if (++polls % 64 == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleepers_.fetch_add(1);
        wake_cv_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
      }
    }
    seen = gen;
    if (stop_.load()) return;
    run_items(index + 1);
  }
}

RoundTiming WorkerPool::parallel_for(int64_t n_items, const std::function<void(int64_t, int)>& fn, int64_t min_chunk) {
  RoundTiming timing;
  if (n_items <= 0) return timing;
  std::lock_guard<std::mutex> call_lock(call_mu_);
  failed_ = false;
  error_.clear();
  if (n_items <= kMaxRoundItems) {
    run_round(n_items, fn, min_chunk, timing);
  } else {  // more items than a ticket holds: rounds of at most kMaxRoundItems
    for (int64_t base = 0; base < n_items && !failed_; base += kMaxRoundItems) {
      const std::function<void(int64_t, int)> shifted = [&](int64_t i, int t) { fn(base + i, t); };
      run_round(std::min(kMaxRoundItems, n_items - base), shifted, min_chunk, timing);
    }
  }
  if (failed_) throw std::runtime_error(error_);
  return timing;
}

void WorkerPool::run_round(int64_t n_items, const std::function<void(int64_t, int)>& fn, int64_t min_chunk,
                           RoundTiming& timing) {
  const auto t0 = std::chrono::steady_clock::now();
  fn_.store(&fn, std::memory_order_relaxed);
  chunk_.store(std::max<int64_t>({1, min_chunk, n_items / (8 * n_threads())}), std::memory_order_relaxed);
  min_chunk_.store(std::max<int64_t>(1, min_chunk), std::memory_order_relaxed);
  items_done_.store(0, std::memory_order_relaxed);
  ++round_;
  ticket_.store(pack_ticket(round_, static_cast<uint64_t>(n_items), 0), std::memory_order_release);
  if (!threads_.empty() && n_items > chunk_.load(std::memory_order_relaxed)) {  // else one claim: the caller's
    generation_.fetch_add(1, std::memory_order_acq_rel);  // wake the workers
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mu_); }
      wake_cv_.notify_all();
    }
  }
  run_items(0);
  const auto t_own = std::chrono::steady_clock::now();
  while (items_done_.load(std::memory_order_acquire) < n_items) FTJAX_PAUSE();
  fn_.store(nullptr, std::memory_order_relaxed);
  const auto t1 = std::chrono::steady_clock::now();
  timing.wall_us += std::chrono::duration<double, std::micro>(t1 - t0).count();
  timing.wait_us += std::chrono::duration<double, std::micro>(t1 - t_own).count();
}

int64_t worker_self_test(WorkerPool& pool, int rounds, int64_t max_items, uint64_t seed, bool big) {
  int64_t anomalies = 0;
  uint64_t state = seed * 6364136223846793005ull + 1442695040888963407ull;
  auto next = [&] { state = state * 6364136223846793005ull + 1442695040888963407ull; return state >> 33; };
  std::vector<std::atomic<int>> hits(static_cast<size_t>(std::max<int64_t>(max_items, 1)));
  const int n_threads = pool.n_threads();
  std::atomic<int64_t> bad_thread{0};
  auto check_round = [&](int64_t n, int64_t min_chunk) {
    for (int64_t i = 0; i < n; ++i) hits[i].store(0, std::memory_order_relaxed);
    pool.parallel_for(n, [&](int64_t i, int t) {
      if (t < 0 || t >= n_threads) bad_thread.fetch_add(1);
      if (i % 5 == 4) {  // uneven items; a caller returning before its items finish sees a 0 below
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
        while (std::chrono::steady_clock::now() < until) {
        }
      }
      hits[i].fetch_add(1, std::memory_order_relaxed);
    }, min_chunk);
    for (int64_t i = 0; i < n; ++i) anomalies += hits[i].load() != 1;
  };
  for (int r = 0; r < rounds; ++r) {  // every other round with claims of up to 9 items
    const int64_t n = static_cast<int64_t>(next() % (max_items + 1));
    check_round(n, r % 2 ? 1 + static_cast<int64_t>(next() % 9) : 1);
  }
  if (big) {  // more items than one ticket holds: split into rounds, each item once
    const int64_t n = (int64_t{1} << 24) + 5;
    std::vector<uint8_t> once(static_cast<size_t>(n), 0);
    std::atomic<int64_t> dup{0};
    pool.parallel_for(n, [&](int64_t i, int) { if (once[i]++) dup.fetch_add(1); });
    for (int64_t i = 0; i < n; ++i) anomalies += once[i] != 1;
    anomalies += dup.load();
  }
  bool threw = false;
  try {
    pool.parallel_for(std::max<int64_t>(max_items, 2), [&](int64_t i, int) {
      if (i == 1) throw std::runtime_error("planted");
    });
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()) == "planted";
  }
  anomalies += !threw;
  check_round(std::max<int64_t>(max_items, 1), 1);  // the pool still works after a failure
  return anomalies + bad_thread.load();
}

namespace {
std::mutex g_workers_mu;
std::unique_ptr<WorkerPool> g_workers;
}  // namespace

WorkerPool& global_workers() {
  std::lock_guard<std::mutex> lock(g_workers_mu);
  if (!g_workers) g_workers = std::make_unique<WorkerPool>(WorkerConfig{});
  return *g_workers;
}

void configure_global_workers(const WorkerConfig& cfg) {
  auto fresh = std::make_unique<WorkerPool>(cfg);
  std::lock_guard<std::mutex> lock(g_workers_mu);
  g_workers = std::move(fresh);
}

}  // namespace ftjax
