// CPU branch inside a jitted GPU step: cpu_experts_submit / cpu_experts_collect (platform CUDA).
//
// submit: copy x and the task list into the channel's pinned staging (stream-ordered), then a
//   1-thread kernel publishes the request: n_valid and shape, a system fence, submit_seq + 1.
// The coordinator thread polls submit_seq of every channel, runs the tasks on the worker pool,
//   writes y into staging, then status and done_seq.
// collect: a 1-block kernel waits until done_seq reaches the submitted sequence number or the
//   watchdog timeout passes (%globaltimer), then a copy kernel moves y to the device, filling NaN
//   and status != 0 if the CPU branch failed or made no progress in time: never a hang.
// Everything per step (sequence numbers, counts) is written by the GPU, so the calls replay
// correctly when XLA captures them in a command buffer.
// fused=1 (the Python wrappers' default; calls up to kFusedMaxBytes): submit is one kernel that stores
//   x and the first n_valid tasks straight into the mapped staging and publishes (no memcpy nodes),
//   and collect is one kernel that waits and copies y back: 2 graph nodes per layer instead of up to 7.
// The host plan (cpu_experts_publish + cpu_experts_collect_checked, host_plan.h): publish stages x, the
//   router's ids and gate weights and, per route, what the plan reads of the cache state (the expert's slot
//   and recency, the slot's last_use, the count of evictable slots), before the GPU's plan kernel; the
//   coordinator plans the CPU branch's tasks itself and runs them, so the CPU call starts after the router,
//   not after the plan kernel and a submit kernel. Every layer call is published (the host's task list may
//   be empty); the checked collect compares the host's task count and checksum with the device plan's and
//   fails the call (status kPlanMismatch, y NaN) if they differ.
// Stamps (every channel, always on; `channel_stamps`): the fused submit and collect kernels write, per call, the
//   %globaltimer at their start, at the publication, when done_seq was seen and at the end, into a ring in mapped
//   memory (a row per call, counted in device memory: no PCIe read on the way), and the coordinator its own clock
//   when it saw a request and when it published done, so that a decode layer's handshake can be cut into the GPU's
//   work, its wait and the two PCIe crossings (bench/layer_stamps.py).
// An empty task list (n_valid <= 0, decided on the GPU) is never published: the submit token is
// kSkipped (0; real sequence numbers skip 0 when they wrap) and collect writes zeros without
// waiting, so layers whose misses were all filled pay no round trip to the CPU.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_common.h"
#include "ffi_cuda.h"
#include "fill_device.cuh"
#include "handshake_device.cuh"
#include "host_plan.h"
#include "moe.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

struct Channel {
  int64_t id, max_tokens, max_tasks, hidden;
  uint64_t pool_id;
  HandshakeCtrl* ctrl = nullptr;  // mapped pinned: host view
  HandshakeCtrl* ctrl_dev = nullptr;
  uint8_t* stage = nullptr;       // x (f32-sized), tok, eid, w, unit starts, y
  uint8_t* stage_dev = nullptr;
  size_t x_off, tok_off, eid_off, w_off, u_off, y_off, bytes;
  size_t lu_off, valid_off;  // kPlanRequest only (ids, slots, gate weights, recency: the task arrays' places)
  uint32_t handled = 0;
  std::atomic<uint64_t> jobs{0}, serve_ns{0};  // completed jobs, their time in serve()
  StampsDev stamps{};                           // the GPU's rows (counts on the device, the ring mapped)
  int64_t* stamp_ring = nullptr;                // host view of stamps.ring
  std::vector<int64_t> host_stamps = std::vector<int64_t>(kStampRing * kHostStampFields);
  std::atomic<uint64_t> n_host_stamps{0};       // requests served (rows written) so far
  std::mutex err_mu;
  std::string error;
};

class Coordinator {
 public:
  ~Coordinator() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  Channel* get(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = channels_.find(id);
    return it == channels_.end() ? nullptr : it->second.get();
  }
  void add(std::unique_ptr<Channel> ch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (channels_.count(ch->id)) throw std::invalid_argument("channel " + std::to_string(ch->id) + " exists");
    channels_[ch->id] = std::move(ch);
    snapshot_version_.fetch_add(1);
    if (!thread_.joinable()) thread_ = std::thread(&Coordinator::run, this);
  }
  // Takes the channel out of the served set; returns it once the coordinator thread no longer holds a
  // pointer to it (it has taken a snapshot without it), so the caller may free its memory.
  std::unique_ptr<Channel> remove(int64_t id) {
    std::unique_ptr<Channel> ch;
    uint64_t version;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = channels_.find(id);
      if (it == channels_.end()) throw std::invalid_argument("channel " + std::to_string(id) + " was not created");
      ch = std::move(it->second);
      channels_.erase(it);
      version = snapshot_version_.fetch_add(1) + 1;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (thread_.joinable() && seen_version_.load() < version) {
      if (std::chrono::steady_clock::now() > deadline) {
        ch.release();  // the thread may still read it: leak rather than free under it
        throw std::runtime_error("channel " + std::to_string(id) + ": the coordinator did not let go of it in 10 s");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return ch;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return channels_.size();
  }

 private:
  void serve(Channel& ch, uint32_t seq) {
    const auto t0 = std::chrono::steady_clock::now();
    HandshakeCtrl& c = *ch.ctrl;
    int32_t status = kOk;
    bool job = true;  // (a planned call with no task is not counted as a job)
    try {
      auto pool = find_pool(ch.pool_id);
      if (!pool) throw std::runtime_error("host pool " + std::to_string(ch.pool_id) + " is gone");
      const int64_t T = c.n_tokens, n = c.n_valid;
      if (T < 0 || T > ch.max_tokens || n < 0 || n > c.task_capacity || c.task_capacity > ch.max_tasks)
        throw std::runtime_error("corrupt request: T=" + std::to_string(T) + " n_valid=" + std::to_string(n));
      if (c.kind == kPlanRequest) {
        c.plan_n = -1;
        const int64_t k = c.top_k;
        if (k < 1 || T < 1 || T * k > ch.max_tasks || T * k != n)
          throw std::runtime_error("corrupt plan request: T=" + std::to_string(T) + " k=" + std::to_string(k));
        int32_t plan[kPlanStatics];
        for (int i = 0; i < kPlanStatics; ++i) plan[i] = c.plan[i];
        const HostPlanStatics st = host_plan_statics(T, k, plan);
        if ((st.layer + 1) * st.n_experts > pool->n_experts())
          throw std::runtime_error("plan request: layer " + std::to_string(st.layer) + " outside the pool");
        HostPlanInputs in;
        in.ids = reinterpret_cast<const int32_t*>(ch.stage + ch.tok_off);
        in.slot = reinterpret_cast<const int32_t*>(ch.stage + ch.eid_off);
        in.gate = reinterpret_cast<const float*>(ch.stage + ch.w_off);
        in.recency = reinterpret_cast<const int32_t*>(ch.stage + ch.u_off);
        in.slot_lu = reinterpret_cast<const int32_t*>(ch.stage + ch.lu_off);
        in.valid = reinterpret_cast<const int32_t*>(ch.stage + ch.valid_off);
        in.step = c.step;
        in.below = c.below;
        in.fill_fraction = c.fill_fraction;
        thread_local HostPlanTasks t;
        host_plan_tasks(st, in, &t);
        job = t.n > 0;
        if (job) {
          ExpertCall call{pool.get(), ch.stage + ch.x_off, c.x_bf16 != 0, T, t.token.data(), t.flat.data(),
                          t.weight.data(), t.n, reinterpret_cast<float*>(ch.stage + ch.y_off), t.units.data()};
          run_experts(global_workers(), call, active_tier());
        }
        c.plan_sum = t.checksum;
        c.plan_n = static_cast<int32_t>(t.n);  // (collect reads y only when it is nonzero)
      } else {
        ExpertCall call{pool.get(), ch.stage + ch.x_off, c.x_bf16 != 0, T,
                        reinterpret_cast<const int32_t*>(ch.stage + ch.tok_off),
                        reinterpret_cast<const int32_t*>(ch.stage + ch.eid_off),
                        reinterpret_cast<const float*>(ch.stage + ch.w_off), n,
                        reinterpret_cast<float*>(ch.stage + ch.y_off),
                        reinterpret_cast<const int32_t*>(ch.stage + ch.u_off)};
        run_experts(global_workers(), call, active_tier());
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(ch.err_mu);
      ch.error = e.what();
      status = kCpuError;
    }
    c.status = status;
    if (job) {
      ch.serve_ns.fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
      ch.jobs.fetch_add(1);  // before done_seq: a caller that saw y also sees the count
    }
    const uint64_t row = ch.n_host_stamps.load(std::memory_order_relaxed);
    int64_t* h = ch.host_stamps.data() + (row % kStampRing) * kHostStampFields;
    h[kHostSeq] = seq;
    h[kHostSeen] = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
    h[kHostJob] = job;
    h[kHostDone] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now().time_since_epoch()).count();
    ch.n_host_stamps.store(row + 1, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_release);  // y, status and the plan's count before done_seq
    c.done_seq = seq;
  }

  void run() {
    pthread_setname_np(pthread_self(), "ftjax-coord");  // bench/thread_cpu.py tells its CPU time apart
    using clock = std::chrono::steady_clock;
    auto last_job = clock::now();
    std::vector<Channel*> list;
    uint64_t version = ~0ull;
    while (!stop_.load(std::memory_order_relaxed)) {
      if (snapshot_version_.load() != version) {
        std::lock_guard<std::mutex> lock(mu_);
        version = snapshot_version_.load();
        list.clear();
        for (auto& kv : channels_) list.push_back(kv.second.get());
        seen_version_.store(version);  // no pointer of an older snapshot is used after this
      }
      bool any = false;
      for (Channel* ch : list) {
        const uint32_t seq = ch->ctrl->submit_seq;
        if (seq != ch->handled) {
          std::atomic_thread_fence(std::memory_order_acquire);
          ch->handled = seq;
          serve(*ch, seq);
          any = true;
        }
      }
      if (any) {
        last_job = clock::now();
      } else if (clock::now() - last_job > std::chrono::milliseconds(50)) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));  // idle: poll gently
      } else {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
  }

  std::mutex mu_;
  std::map<int64_t, std::unique_ptr<Channel>> channels_;
  std::atomic<uint64_t> snapshot_version_{0};
  std::atomic<uint64_t> seen_version_{0};  // the snapshot the coordinator thread is using
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

Coordinator& coordinator() {
  static Coordinator* c = new Coordinator();  // leaked on purpose: no teardown races at exit
  return *c;
}


constexpr int64_t kFusedMaxBytes = 128 << 10;  // larger calls (prefill chunks) take the memcpy path

__global__ void wait_kernel(const HandshakeCtrl* ctrl, const int32_t* token, uint64_t timeout_ns, int32_t* status,
                            int32_t* words) {
  *status = wait_done(ctrl, token, timeout_ns);
  cpu_branch_left(token, words);
}


__device__ void publish(HandshakeCtrl* ctrl, const int32_t* n_valid, int32_t n_tokens, int32_t x_bf16,
                        int32_t capacity, int32_t* token, int32_t* words) {
  if (*n_valid <= 0) {  // nothing for the CPU: no request, collect returns zeros at once
    *token = kSkipped;
    return;
  }
  publish_now(ctrl, kTaskRequest, *n_valid, n_tokens, x_bf16, capacity, token, words);
}

__global__ void ring_kernel(HandshakeCtrl* ctrl, const int32_t* n_valid, int32_t n_tokens, int32_t x_bf16,
                            int32_t capacity, int32_t* token, int32_t* words) {
  publish(ctrl, n_valid, n_tokens, x_bf16, capacity, token, words);
}

// One block: x and the first n_valid tasks into the mapped staging (zero-copy stores over PCIe) and the
// request's fields (thread 0), then every thread's system fence, the block barrier, and the seq by thread 0.
__global__ void submit_fused_kernel(HandshakeCtrl* ctrl, uint8_t* stage, int64_t x_off, int64_t tok_off,
                                    int64_t eid_off, int64_t w_off, int64_t u_off, const uint8_t* __restrict__ x,
                                    int64_t x_bytes, const int32_t* __restrict__ tok, const int32_t* __restrict__ eid,
                                    const float* __restrict__ w, const int32_t* __restrict__ units,
                                    const int32_t* n_valid, int32_t n_tokens,
                                    int32_t x_bf16, int32_t capacity, int32_t* token, int32_t* words,
                                    StampsDev stamps) {
  int64_t* row = nullptr;
  if (threadIdx.x == 0) {
    row = stamp_row(stamps, 0);
    row[kStSubmitStart] = static_cast<int64_t>(global_ns());
  }
  if (*n_valid <= 0) {  // uniform across the block: stage nothing
    if (threadIdx.x == 0) {
      *token = kSkipped;
      row[kStSubmitSeq] = kSkipped;
      row[kStPublished] = static_cast<int64_t>(global_ns());
    }
    return;
  }
  const int64_t n16 = x_bytes / 16;  // x_bytes and both ends are 16-byte aligned (checked by the host)
  const int4* xs = reinterpret_cast<const int4*>(x);
  int4* xd = reinterpret_cast<int4*>(stage + x_off);
  for (int64_t i = threadIdx.x; i < n16; i += blockDim.x) xd[i] = xs[i];
  const int32_t n = min(max(*n_valid, 0), capacity);
  int32_t* td = reinterpret_cast<int32_t*>(stage + tok_off);
  int32_t* ed = reinterpret_cast<int32_t*>(stage + eid_off);
  float* wd = reinterpret_cast<float*>(stage + w_off);
  int32_t* ud = reinterpret_cast<int32_t*>(stage + u_off);
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    td[i] = tok[i];
    ed[i] = eid[i];
    wd[i] = w[i];
    ud[i] = units[i];
  }
  // The request in two halves (handshake_device.cuh): thread 0's read of the last seq and its field stores
  // overlap the staging, one system fence orders both before the seq, and nothing follows the seq's store
  // (the plan kernel's publish does the same). n_valid > 0 here: the block returned above otherwise.
  uint32_t seq = 0;
  if (threadIdx.x == 0) seq = request_fields(ctrl, kTaskRequest, *n_valid, n_tokens, x_bf16, capacity);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    request_publish(ctrl, seq, token, words);
    row[kStSubmitSeq] = seq;
    row[kStPublished] = static_cast<int64_t>(global_ns());
  }
}

// Every block's thread 0 waits (wait_done: one poll per block), then the block copies its share of y
// back from the staging with 16-byte uncached loads, all in flight at once: a PCIe read costs ~1-2 us of
// latency, so one block of 4-byte loads in a loop (the first version) spent ~50 us on 64 KiB.
// y (skipped call: zeros; failed or timed-out CPU branch: NaN). n4 float4 chunks, then a scalar tail.
__global__ void collect_fused_kernel(const HandshakeCtrl* ctrl, const int32_t* token, uint64_t timeout_ns,
                                     const float* y_stage, float* __restrict__ y, int64_t n, bool vec,
                                     int32_t* status, int32_t* words, StampsDev stamps) {
  __shared__ int32_t st;
  int64_t* row = nullptr;  // (block 0's thread 0)
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) {
      row = stamp_row(stamps, 1);
      row[kStCollectStart] = static_cast<int64_t>(global_ns());
    }
    st = wait_done(ctrl, token, timeout_ns);
    if (row) {
      row[kStCollectSeq] = *token;
      row[kStDoneSeen] = static_cast<int64_t>(global_ns());
    }
    __threadfence_system();  // y was written before done_seq: read it only after seeing done_seq
    if (blockIdx.x == 0) {
      *status = st;
      cpu_branch_left(token, words);
    }
  }
  __syncthreads();
  const bool skipped = static_cast<uint32_t>(*token) == kSkipped, ok = st == kOk;
  const float fill = skipped ? 0.f : NAN;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n4 = vec ? n / 4 : 0;
  for (int64_t i = first; i < n4; i += stride)
    reinterpret_cast<float4*>(y)[i] = ok && !skipped ? __ldcv(reinterpret_cast<const float4*>(y_stage) + i)
                                                     : make_float4(fill, fill, fill, fill);
  for (int64_t i = 4 * n4 + first; i < n; i += stride) y[i] = ok && !skipped ? __ldcv(y_stage + i) : fill;
  if (row) row[kStCollectEnd] = static_cast<int64_t>(global_ns());  // (block 0's share of y copied)
}

__global__ void copy_out_kernel(const float* __restrict__ y_stage, float* __restrict__ y, int64_t n,
                                const int32_t* token, const int32_t* status) {
  const bool skipped = static_cast<uint32_t>(*token) == kSkipped, ok = *status == kOk;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = skipped ? 0.f : ok ? y_stage[i] : NAN;
}

ffi::Error SubmitImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> eid,
                      ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> units, ffi::Buffer<ffi::S32> n_valid,
                      ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t channel, int64_t fused) {
  Channel* ch = coordinator().get(channel);
  if (!ch) return ffi::Error::InvalidArgument("cpu_experts_submit: channel " + std::to_string(channel) +
                                              " was not created (ftjax.host.cuda.create_channel)");
  const auto xd = x.dimensions();
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (xd.size() != 2 || xd[1] != ch->hidden || xd[0] > ch->max_tokens ||
      (!bf16 && x.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("cpu_experts_submit: x must be f32/bf16 [T <= " +
                                       std::to_string(ch->max_tokens) + ", " + std::to_string(ch->hidden) + "]");
  const int64_t cap = static_cast<int64_t>(tok.element_count());
  if (cap > ch->max_tasks || static_cast<int64_t>(eid.element_count()) != cap ||
      static_cast<int64_t>(w.element_count()) != cap || static_cast<int64_t>(units.element_count()) != cap)
    return ffi::Error::InvalidArgument("cpu_experts_submit: task arrays must have one length <= " +
                                       std::to_string(ch->max_tasks));
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (fused && static_cast<int64_t>(x.size_bytes()) <= kFusedMaxBytes && x.size_bytes() % 16 == 0 &&
      aligned(x.untyped_data())) {
    submit_fused_kernel<<<1, kFusedThreads, 0, stream>>>(
        ch->ctrl_dev, ch->stage_dev, static_cast<int64_t>(ch->x_off), static_cast<int64_t>(ch->tok_off),
        static_cast<int64_t>(ch->eid_off), static_cast<int64_t>(ch->w_off), static_cast<int64_t>(ch->u_off),
        static_cast<const uint8_t*>(x.untyped_data()), static_cast<int64_t>(x.size_bytes()), tok.typed_data(),
        eid.typed_data(), w.typed_data(), units.typed_data(), n_valid.typed_data(), static_cast<int32_t>(xd[0]),
        bf16 ? 1 : 0, static_cast<int32_t>(cap), token->typed_data(), transfer_words(false), ch->stamps);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return ffi::Error::Internal(std::string("cpu_experts_submit: ") + cudaGetErrorString(err));
    return ffi::Error::Success();
  }
  cudaMemcpyAsync(ch->stage + ch->x_off, x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToHost, stream);
  if (cap) {
    cudaMemcpyAsync(ch->stage + ch->tok_off, tok.typed_data(), cap * 4, cudaMemcpyDeviceToHost, stream);
    cudaMemcpyAsync(ch->stage + ch->eid_off, eid.typed_data(), cap * 4, cudaMemcpyDeviceToHost, stream);
    cudaMemcpyAsync(ch->stage + ch->w_off, w.typed_data(), cap * 4, cudaMemcpyDeviceToHost, stream);
    cudaMemcpyAsync(ch->stage + ch->u_off, units.typed_data(), cap * 4, cudaMemcpyDeviceToHost, stream);
  }
  ring_kernel<<<1, 1, 0, stream>>>(ch->ctrl_dev, n_valid.typed_data(), static_cast<int32_t>(xd[0]), bf16 ? 1 : 0,
                                   static_cast<int32_t>(cap), token->typed_data(), transfer_words(false));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("cpu_experts_submit: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error CollectImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::Result<ffi::Buffer<ffi::F32>> y,
                       ffi::Result<ffi::Buffer<ffi::S32>> status, int64_t channel, int64_t timeout_ms, int64_t fused) {
  Channel* ch = coordinator().get(channel);
  if (!ch) return ffi::Error::InvalidArgument("cpu_experts_collect: channel " + std::to_string(channel) +
                                              " was not created");
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[1] != ch->hidden || yd[0] > ch->max_tokens)
    return ffi::Error::InvalidArgument("cpu_experts_collect: y must be [T <= max_tokens, hidden]");
  if (timeout_ms <= 0) return ffi::Error::InvalidArgument("cpu_experts_collect: timeout_ms must be > 0");
  if (fused && static_cast<int64_t>(y->size_bytes()) <= kFusedMaxBytes) {
    const int64_t n = static_cast<int64_t>(y->element_count());
    const bool vec = reinterpret_cast<uintptr_t>(y->untyped_data()) % 16 == 0;  // the staging is 256-aligned
    const int blocks = static_cast<int>(std::clamp<int64_t>((n / 4 + kCollectThreads - 1) / kCollectThreads, 1, 16));
    collect_fused_kernel<<<blocks, kCollectThreads, 0, stream>>>(
        ch->ctrl_dev, token.typed_data(), static_cast<uint64_t>(timeout_ms) * 1000000ull,
        reinterpret_cast<const float*>(ch->stage_dev + ch->y_off), y->typed_data(), n, vec, status->typed_data(),
        transfer_words(false), ch->stamps);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return ffi::Error::Internal(std::string("cpu_experts_collect: ") + cudaGetErrorString(err));
    return ffi::Error::Success();
  }
  wait_kernel<<<1, 1, 0, stream>>>(ch->ctrl_dev, token.typed_data(), static_cast<uint64_t>(timeout_ms) * 1000000ull,
                                   status->typed_data(), transfer_words(false));
  const int64_t n = static_cast<int64_t>(y->element_count());
  const int blocks = static_cast<int>(std::min<int64_t>(132, (n + 255) / 256));
  if (n)
    copy_out_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const float*>(ch->stage_dev + ch->y_off),
                                                y->typed_data(), n, token.typed_data(), status->typed_data());
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("cpu_experts_collect: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}


#define FTJAX_SUBMIT_BINDING                                                                        \
  ffi::Ffi::Bind()                                                                                  \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                                                     \
      .Arg<ffi::AnyBuffer>()                                                                        \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Attr<int64_t>("channel")                                                                     \
      .Attr<int64_t>("fused")
#define FTJAX_COLLECT_BINDING                                                                       \
  ffi::Ffi::Bind()                                                                                  \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                                                     \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::F32>>()                                                                 \
      .Ret<ffi::Buffer<ffi::S32>>()                                                                 \
      .Attr<int64_t>("channel")                                                                     \
      .Attr<int64_t>("timeout_ms")                                                                  \
      .Attr<int64_t>("fused")
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuSubmit, SubmitImpl, FTJAX_SUBMIT_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuSubmitNoCmdBuffer, SubmitImpl, FTJAX_SUBMIT_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuCollect, CollectImpl, FTJAX_COLLECT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuCollectNoCmdBuffer, CollectImpl, FTJAX_COLLECT_BINDING);

void* cpu_submit_handler(bool cb) {
  return cb ? reinterpret_cast<void*>(FtjaxCpuSubmit) : reinterpret_cast<void*>(FtjaxCpuSubmitNoCmdBuffer);
}
void* cpu_collect_handler(bool cb) {
  return cb ? reinterpret_cast<void*>(FtjaxCpuCollect) : reinterpret_cast<void*>(FtjaxCpuCollectNoCmdBuffer);
}

void create_channel(int64_t channel, uint64_t pool_id, int64_t max_tokens, int64_t max_tasks) {
  auto pool = find_pool(pool_id);
  if (!pool) throw std::invalid_argument("no host pool with id " + std::to_string(pool_id));
  if (max_tokens < 1 || max_tasks < 1)
    throw std::invalid_argument("max_tokens and max_tasks must be >= 1, got " + std::to_string(max_tokens) + ", " +
                                std::to_string(max_tasks));
  transfer_words(true);  // (made here, outside graph capture, for the submits and collects recorded later)
  auto ch = std::make_unique<Channel>();
  ch->id = channel;
  ch->pool_id = pool_id;
  ch->max_tokens = max_tokens;
  ch->max_tasks = max_tasks;
  ch->hidden = pool->hidden();
  auto up = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t xy = up(static_cast<size_t>(max_tokens) * ch->hidden * 4), tasks = up(static_cast<size_t>(max_tasks) * 4);
  ch->x_off = 0;
  ch->tok_off = xy;
  ch->eid_off = ch->tok_off + tasks;
  ch->w_off = ch->eid_off + tasks;
  ch->u_off = ch->w_off + tasks;
  ch->lu_off = ch->u_off + tasks;
  ch->valid_off = ch->lu_off + tasks;
  ch->y_off = ch->valid_off + up(static_cast<size_t>(max_tokens) * 4);
  ch->bytes = ch->y_off + xy;
  void* p = nullptr;
  cuda_check(cudaHostAlloc(&p, sizeof(HandshakeCtrl), cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  std::memset(p, 0, sizeof(HandshakeCtrl));
  ch->ctrl = static_cast<HandshakeCtrl*>(p);
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ch->ctrl_dev), p, 0), "cudaHostGetDevicePointer");
  cuda_check(cudaHostAlloc(&p, ch->bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  ch->stage = static_cast<uint8_t*>(p);
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ch->stage_dev), p, 0), "cudaHostGetDevicePointer");
  cuda_check(cudaMalloc(&p, 2 * sizeof(uint64_t)), "cudaMalloc");
  ch->stamps.counts = static_cast<uint64_t*>(p);
  cuda_check(cudaMemset(p, 0, 2 * sizeof(uint64_t)), "cudaMemset");
  const size_t ring = sizeof(int64_t) * kStampRing * kStFields;
  cuda_check(cudaHostAlloc(&p, ring, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  std::memset(p, 0, ring);
  ch->stamp_ring = static_cast<int64_t*>(p);
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ch->stamps.ring), p, 0), "cudaHostGetDevicePointer");
  coordinator().add(std::move(ch));
}

void destroy_channel(int64_t channel) {
  // The GPU first: a submit or collect still in flight reads the staging, and the coordinator must
  // still serve it (a collect would otherwise wait for its watchdog).
  cuda_check(cudaDeviceSynchronize(), "destroy_channel");
  std::unique_ptr<Channel> ch = coordinator().remove(channel);
  cudaFreeHost(ch->stage);
  cudaFreeHost(ch->ctrl);
  cudaFree(ch->stamps.counts);
  cudaFreeHost(ch->stamp_ring);
}

bool channel_view(int64_t channel, ChannelView* out) {
  Channel* ch = coordinator().get(channel);
  if (!ch) return false;
  *out = ChannelView{ch->ctrl_dev, ch->stage_dev, ch->x_off, ch->tok_off, ch->eid_off, ch->w_off, ch->u_off,
                     ch->lu_off, ch->valid_off, ch->y_off, ch->hidden, ch->max_tokens, ch->max_tasks};
  return true;
}

int64_t live_channels() { return static_cast<int64_t>(coordinator().size()); }

std::string channel_error(int64_t channel) {
  Channel* ch = coordinator().get(channel);
  if (!ch) throw std::invalid_argument("channel " + std::to_string(channel) + " was not created");
  std::lock_guard<std::mutex> lock(ch->err_mu);
  return ch->error;
}

uint64_t channel_jobs(int64_t channel) {
  Channel* ch = coordinator().get(channel);
  if (!ch) throw std::invalid_argument("channel " + std::to_string(channel) + " was not created");
  return ch->jobs.load();
}

StampCounts channel_stamps(int64_t channel, int64_t* gpu, int64_t* host) {
  Channel* ch = coordinator().get(channel);
  if (!ch) throw std::invalid_argument("channel " + std::to_string(channel) + " was not created");
  uint64_t counts[2];
  cuda_check(cudaMemcpy(counts, ch->stamps.counts, sizeof(counts), cudaMemcpyDeviceToHost), "channel_stamps");
  std::memcpy(gpu, ch->stamp_ring, sizeof(int64_t) * kStampRing * kStFields);
  const uint64_t n_host = ch->n_host_stamps.load(std::memory_order_acquire);
  std::memcpy(host, ch->host_stamps.data(), sizeof(int64_t) * kStampRing * kHostStampFields);
  return StampCounts{counts[0], counts[1], n_host};
}

double channel_serve_seconds(int64_t channel) {
  Channel* ch = coordinator().get(channel);
  if (!ch) throw std::invalid_argument("channel " + std::to_string(channel) + " was not created");
  return ch->serve_ns.load() * 1e-9;
}

}  // namespace ftjax
