// The bench probes' thread team (bench/int4_repack.cc, bench/down_layout.cc): persistent threads, each pinned,
// spinning between rounds as the runtime's pool does beside a GPU; the caller is thread 0. Not the runtime's pool
// (cpp/workers.cc): a probe's own, so a layout or call form can be tried without touching the runtime.
#pragma once
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#if defined(__x86_64__) && !defined(PROBE_NO_PAUSE)
#include <immintrin.h>
#endif

namespace probe {

inline void cpu_relax() {
#if defined(__x86_64__) && !defined(PROBE_NO_PAUSE)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Team {
 public:
  explicit Team(int n) : n_(n) {
    const int cpus = static_cast<int>(std::thread::hardware_concurrency());
    pin(0, cpus);
    for (int i = 1; i < n; ++i)
      threads_.emplace_back([this, i, cpus] {
        pin(i, cpus);
        uint64_t seen = 0;
        for (;;) {
          uint64_t g;
          while ((g = gen_.load(std::memory_order_acquire)) == seen) cpu_relax();
          seen = g;
          if (stop_.load(std::memory_order_acquire)) return;
          work(i);
          done_.fetch_add(1, std::memory_order_acq_rel);
        }
      });
  }
  ~Team() {
    stop_.store(true, std::memory_order_release);
    gen_.fetch_add(1, std::memory_order_acq_rel);
    for (auto& t : threads_) t.join();
  }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;
  int size() const { return n_; }
  // fn(item, thread) for every item in [0, n) on all threads; returns when every item ran.
  // contiguous = true: thread k takes items [k n / N, (k + 1) n / N), one stretch each (no claims).
  void run(int64_t n, const std::function<void(int64_t, int)>& fn, bool contiguous = false) {
    fn_ = &fn;
    contiguous_ = contiguous;
    n_items_ = n;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_acq_rel);
    work(0);
    while (done_.load(std::memory_order_acquire) < n_ - 1) cpu_relax();
  }

 private:
  static void pin(int i, int cpus) {  // thread i on CPU (i + 1) mod cpus: with fewer threads than CPUs, CPU 0 stays
    if (cpus <= 1) return;            // with the system
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((i + 1) % cpus, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  void work(int k) {
    if (contiguous_) {
      for (int64_t i = k * n_items_ / n_; i < (k + 1) * n_items_ / n_; ++i) (*fn_)(i, k);
      return;
    }
    for (;;) {
      const int64_t i = next_.fetch_add(1, std::memory_order_acq_rel);
      if (i >= n_items_) return;
      (*fn_)(i, k);
    }
  }
  int n_;
  std::vector<std::thread> threads_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_items_ = 0;
  bool contiguous_ = false;
  alignas(64) std::atomic<int64_t> next_{0};
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<uint64_t> gen_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace probe
