#include "workers.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
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

std::vector<int> physical_core_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  std::map<std::pair<int, int>, int> first_of_core;  // (package, core) -> first logical CPU
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    const std::string topo = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    const auto key = std::make_pair(read_int(topo + "physical_package_id", 0), read_int(topo + "core_id", c));
    first_of_core.emplace(key, c);
  }
  for (auto& kv : first_of_core) cpus.push_back(kv.second);
  std::sort(cpus.begin(), cpus.end());
  return cpus;
}

WorkerPool::WorkerPool(const WorkerConfig& cfg) : cfg_(cfg) {
  const auto cores = physical_core_cpus();
  int n = cfg.n_workers;
  if (n < 0) n = std::max(0, static_cast<int>(cores.size()) - 2);
  if (n > 1024) throw std::invalid_argument("n_workers " + std::to_string(n) + " is too large (max 1024)");
  cfg_.n_workers = n;
  // Core 0 of the list stays with the caller (the coordinator); workers take the rest, wrapping.
  // cpus_ is complete before any thread starts: workers read it.
  if (cfg.pin && cores.size() > 1)
    for (int i = 0; i < n; ++i) cpus_.push_back(cores[(i + 1) % cores.size()]);
  for (int i = 0; i < n; ++i) threads_.emplace_back(&WorkerPool::worker_main, this, i);
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

void WorkerPool::run_items(int thread) {
  for (;;) {
    const int64_t i = next_item_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_items_) return;
    try {
      (*fn_)(i, thread);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(err_mu_);
      if (!failed_) error_ = e.what();
      failed_ = true;
      next_item_.store(n_items_);  // stop handing out work
    } catch (...) {
      std::lock_guard<std::mutex> lock(err_mu_);
      if (!failed_) error_ = "unknown exception in a worker";
      failed_ = true;
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
    workers_done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void WorkerPool::parallel_for(int64_t n_items, const std::function<void(int64_t, int)>& fn) {
  if (n_items <= 0) return;
  std::lock_guard<std::mutex> call_lock(call_mu_);
  failed_ = false;
  error_.clear();
  if (threads_.empty() || n_items == 1) {
    fn_ = &fn;
    n_items_ = n_items;
    next_item_.store(0);
    run_items(0);
  } else {
    fn_ = &fn;
    n_items_ = n_items;
    next_item_.store(0, std::memory_order_relaxed);
    workers_done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_acq_rel);  // publishes fn_, n_items_
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mu_); }
      wake_cv_.notify_all();
    }
    run_items(0);
    const int n_workers = static_cast<int>(threads_.size());
    while (workers_done_.load(std::memory_order_acquire) < n_workers) FTJAX_PAUSE();
  }
  fn_ = nullptr;
  if (failed_) throw std::runtime_error(error_);
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
