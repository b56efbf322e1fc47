// Background expert fills, batched per decode step (OffloadExperts(defer_fills=True) on the GPU).
//
// A decode call may defer its fills (plan.defer_fills): its missed experts are computed on the CPU in
// that call, its fill lists go into per-layer rows of the step's state, and once per step, after the
// last layer, `ftjax_bg_fork` hands them all to the side stream: it copies the lists (XLA
// temporaries) into a private ring entry, bumps the background's sequence number, and launches one
// few-block kernel on the side stream that fills layer after layer, publishing done[layer] = sequence
// as each layer's fills land. At the start of every later call of a layer, `ftjax_bg_wait` (a one-thread
// kernel inside XLA's command buffer: all its values are device data) waits until done[layer] has
// reached the sequence, so the layer reads its slots only after its background fill landed. One
// custom call per step runs outside command buffers (the fork launches on another stream), where a
// fork and a join per layer split the step's graph 80 times on 40 layers (bench/RESULTS.md,
// session 9: host time per step 3.5 -> 6.5 ms).
//
// Hazards and why they cannot happen: the plan stamps a deferred slot with the clock of the layer's
// next call, so no call chooses it as a victim or reads it before that call's wait (plan.py); the
// fork reads a private copy of the lists, and an entry of the ring is reused only after XLA's
// stream has waited for the fills that read it; the wait has a timeout (globaltimer) that sets a
// flag the host reads (`background_error`), never a hang.
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cuda_common.h"
#include "ffi_cuda.h"
#include "fill_device.cuh"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

constexpr int kBgRing = 16;

struct Background {
  int64_t layers = 0, max_fill = 0, entry_ints = 0;
  int64_t* seq = nullptr;         // device: forks so far
  int64_t* done = nullptr;        // device [layers]: the fork whose fill of the layer has landed
  int32_t* error_host = nullptr;  // mapped: a wait timed out
  int32_t* error_dev = nullptr;
  int32_t* ring = nullptr;        // device [kBgRing, entry_ints]: one entry per fork (bg_stage's layout)
  int64_t* ring_seq = nullptr;    // device [kBgRing]: the sequence number of the fork that used the entry
  cudaEvent_t ring_done[kBgRing] = {};
  bool ring_used[kBgRing] = {};
  int next = 0;
  int32_t yield_mask = 0;  // YieldMask bits: pause while in-step fills / CPU branches run (set_background_yield)
};

std::mutex bg_mu;
std::map<int64_t, std::unique_ptr<Background>>& backgrounds() {
  static std::map<int64_t, std::unique_ptr<Background>> m;
  return m;
}

Background* find_background(int64_t id) {
  std::lock_guard<std::mutex> lock(bg_mu);
  auto it = backgrounds().find(id);
  return it == backgrounds().end() ? nullptr : it->second.get();
}

// A ring entry: [ids (L*F) | slots (L*F) | n (L) | per-layer block counters (L) | units from (L)].
__global__ void bg_stage(const int32_t* __restrict__ ids, const int32_t* __restrict__ slots,
                         const int32_t* __restrict__ n, const int32_t* __restrict__ from, int32_t* __restrict__ dst,
                         int64_t lf, int64_t layers, int64_t* seq, int64_t* seq_at_fork) {
  for (int64_t i = threadIdx.x; i < lf; i += blockDim.x) {
    dst[i] = ids[i];
    dst[lf + i] = slots[i];
  }
  for (int64_t i = threadIdx.x; i < layers; i += blockDim.x) {
    dst[2 * lf + i] = n[i];
    dst[2 * lf + layers + i] = 0;
    dst[2 * lf + 2 * layers + i] = from[i];
  }
  if (threadIdx.x == 0) *seq_at_fork = ++*seq;  // on XLA's stream: every later wait sees this number
}

// Every layer's fills of one fork in one launch: the grid walks layer 0's valid entries, then layer 1's,
// ...; the last block done with a layer publishes done[layer] = the fork's number (each block fences
// its writes before it counts itself in), so layer l's wait is over as soon as its own fills landed.
// A layer whose `from` is u > 0 (a unit-split call: units [0, u) were filled in the call) copies only
// units [u, I) of its experts (copy_units; bf16/f32 pools, per16 > 0).
__global__ void bg_fill(int32_t* entry, int64_t layers, int64_t F, const int64_t* seq_at_fork, int64_t* done,
                        int64_t n_experts, int64_t n_slots, int64_t hidden, int64_t inter, int64_t per16,
                        const uint4* __restrict__ src0, uint4* __restrict__ dst0, int64_t row0,
                        const uint4* __restrict__ src1, uint4* __restrict__ dst1, int64_t row1,
                        const int32_t* words, int32_t yield_mask, DownT dt) {
  YieldGate gate{words, yield_mask};
  const int64_t worker = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t workers = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int32_t* ids = entry;
  const int32_t* slots = entry + layers * F;
  const int32_t* n = entry + 2 * layers * F;
  unsigned* counters = reinterpret_cast<unsigned*>(entry + 2 * layers * F + layers);
  const int32_t* from = entry + 2 * layers * F + 2 * layers;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t count = min(static_cast<int64_t>(n[l]), F);
    const int64_t u0 = per16 > 0 ? min(max(static_cast<int64_t>(from[l]), int64_t{0}), inter) / 8 * 8 : 0;
    for (int64_t q = 0; q < count; ++q) {
      const int64_t id = ids[l * F + q], slot = slots[l * F + q];
      if (id < 0 || id >= n_experts || slot < 0 || slot >= n_slots) continue;  // masked entry
      if (u0 > 0)
        copy_units(id, slot, u0, inter, worker, workers, hidden, inter, per16, src0, dst0, row0, src1, dst1, row1,
                   &gate, dt);
      else
        copy_expert(id, slot, worker, workers, src0, dst0, row0, src1, dst1, row1, &gate, dt);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(counters + l, 1u) == gridDim.x - 1) {
        __threadfence();
        *reinterpret_cast<volatile int64_t*>(done + l) = *seq_at_fork;
      }
    }
  }
}

__global__ void bg_wait(const int64_t* seq, const volatile int64_t* done, uint64_t timeout_ns, int32_t* error) {
  const int64_t want = *seq;
  if (*done >= want) return;
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (*done < want) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) {
      *reinterpret_cast<volatile int32_t*>(error) = 1;
      __threadfence_system();
      return;
    }
    __nanosleep(200);
  }
  __threadfence();
}

ffi::Error BgWaitImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t bg,
                      int64_t layer, int64_t timeout_ms) {
  if (out->untyped_data() != x.untyped_data())
    return ffi::Error::InvalidArgument("bg_wait: the operand must be aliased to the output");
  Background* b = find_background(bg);
  if (!b) return ffi::Error::InvalidArgument("bg_wait: no background with id " + std::to_string(bg));
  if (layer < 0 || layer >= b->layers)
    return ffi::Error::InvalidArgument("bg_wait: layer " + std::to_string(layer) + " outside the background's " +
                                       std::to_string(b->layers));
  bg_wait<<<1, 1, 0, stream>>>(b->seq, b->done + layer, static_cast<uint64_t>(timeout_ms) * 1000000ull,
                               b->error_dev);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("bg_wait: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error BgForkImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::S32> n_valid, ffi::Buffer<ffi::S32> from, ffi::AnyBuffer gate_up,
                      ffi::AnyBuffer down,
                      ffi::Result<ffi::AnyBuffer> gate_up_out, ffi::Result<ffi::AnyBuffer> down_out, uint64_t pool_id,
                      int64_t bg, int64_t blocks) {
  Background* b = find_background(bg);
  if (!b) return ffi::Error::InvalidArgument("bg_fork: no background with id " + std::to_string(bg));
  auto pool = find_pool(pool_id);
  if (!pool) return ffi::Error::InvalidArgument("bg_fork: no host pool with id " + std::to_string(pool_id));
  const auto dims = ids.dimensions();
  if (dims.size() != 2 || dims[0] != b->layers || dims[1] > b->max_fill || slots.dimensions().size() != 2 ||
      slots.dimensions()[0] != dims[0] || slots.dimensions()[1] != dims[1] ||
      static_cast<int64_t>(n_valid.element_count()) != b->layers ||
      static_cast<int64_t>(from.element_count()) != b->layers)
    return ffi::Error::InvalidArgument("bg_fork: ids and slots must be [layers=" + std::to_string(b->layers) +
                                       ", F <= " + std::to_string(b->max_fill) + "], n_valid and from [layers]");
  const int64_t L = dims[0], F = dims[1], S = gate_up.dimensions().size() ? gate_up.dimensions()[0] : 0;
  if (gate_up.size_bytes() != static_cast<size_t>(S) * pool->gate_up().expert_bytes ||
      down.size_bytes() != static_cast<size_t>(S) * pool->down().expert_bytes)
    return ffi::Error::InvalidArgument("bg_fork: cache sizes do not match the pool's expert rows");
  if (gate_up_out->untyped_data() != gate_up.untyped_data() || down_out->untyped_data() != down.untyped_data())
    return ffi::Error::InvalidArgument("bg_fork: the caches must be aliased to the outputs and donated");
  const Bank& g = pool->gate_up();
  const Bank& d = pool->down();
  if (!pool->pinned() || !g.device_ptr || !d.device_ptr || g.expert_bytes % 16 || d.expert_bytes % 16)
    return ffi::Error::InvalidArgument("bg_fork: the host pool must be pinned, its expert rows multiples of 16 B");
  // units from u > 0 (unit split): bf16/f32 banks only; an int4 pool always copies whole experts
  const int64_t per16 = g.format == WeightFormat::kInt4 ? 0 : g.format == WeightFormat::kBF16 ? 8 : 4;
  try {
    const DownT dt = down_t_of(*pool);
    std::lock_guard<std::mutex> lock(bg_mu);  // one fork at a time per process: the ring and the side stream
    cudaStream_t side = side_stream();
    const int e = b->next;
    b->next = (e + 1) % kBgRing;
    int32_t* entry = b->ring + static_cast<int64_t>(e) * b->entry_ints;
    if (b->ring_used[e]) cuda_check(cudaStreamWaitEvent(stream, b->ring_done[e], 0), "bg_fork: ring wait");
    b->ring_used[e] = true;
    int64_t* seq_at_fork = b->ring_seq + e;
    bg_stage<<<1, 256, 0, stream>>>(ids.typed_data(), slots.typed_data(), n_valid.typed_data(), from.typed_data(),
                                    entry, L * F, L, b->seq, seq_at_fork);
    cuda_check(cudaGetLastError(), "bg_fork: stage");
    fork_to_side(stream);
    bg_fill<<<static_cast<unsigned>(blocks > 0 ? blocks : 16), kFillThreads, 0, side>>>(
        entry, L, F, seq_at_fork, b->done, pool->n_experts(), S, pool->hidden(), pool->inter(), per16,
        static_cast<const uint4*>(g.device_ptr),
        static_cast<uint4*>(gate_up.untyped_data()), g.expert_bytes / 16, static_cast<const uint4*>(d.device_ptr),
        static_cast<uint4*>(down.untyped_data()), d.expert_bytes / 16, transfer_words(false), b->yield_mask, dt);
    cuda_check(cudaGetLastError(), "bg_fork: fills");
    cuda_check(cudaEventRecord(b->ring_done[e], side), "bg_fork: ring event");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("bg_fork: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

int64_t create_background(int64_t layers, int64_t max_fill) {
  if (layers < 1 || max_fill < 1) throw std::invalid_argument("create_background: layers and max_fill must be >= 1");
  transfer_words(true);  // (made outside graph capture, for the in-step fills and handshakes recorded later)
  auto b = std::make_unique<Background>();
  b->layers = layers;
  b->max_fill = max_fill;
  b->entry_ints = 2 * layers * max_fill + 3 * layers;
  cuda_check(cudaMalloc(&b->seq, sizeof(int64_t) * (1 + layers)), "create_background: flags");
  b->done = b->seq + 1;
  cuda_check(cudaMemset(b->seq, 0, sizeof(int64_t) * (1 + layers)), "create_background: flags");
  cuda_check(cudaHostAlloc(&b->error_host, sizeof(int32_t), cudaHostAllocMapped), "create_background: error flag");
  *b->error_host = 0;
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&b->error_dev), b->error_host, 0),
             "create_background: error flag");
  cuda_check(cudaMalloc(&b->ring, sizeof(int32_t) * kBgRing * b->entry_ints), "create_background: list ring");
  cuda_check(cudaMalloc(&b->ring_seq, sizeof(int64_t) * kBgRing), "create_background: list ring");
  for (auto& ev : b->ring_done) cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "create_background");
  cuda_check(cudaDeviceSynchronize(), "create_background");
  std::lock_guard<std::mutex> lock(bg_mu);
  static int64_t next_id = 1;
  const int64_t id = next_id++;
  backgrounds()[id] = std::move(b);
  return id;
}

void destroy_background(int64_t id) {
  cuda_check(cudaDeviceSynchronize(), "destroy_background");  // its fills, waits and stagings have run
  std::unique_ptr<Background> b;
  {
    std::lock_guard<std::mutex> lock(bg_mu);
    auto it = backgrounds().find(id);
    if (it == backgrounds().end()) throw std::invalid_argument("no background with id " + std::to_string(id));
    b = std::move(it->second);
    backgrounds().erase(it);
  }
  for (auto& ev : b->ring_done) cudaEventDestroy(ev);
  cudaFree(b->ring_seq);
  cudaFree(b->ring);
  cudaFree(b->seq);
  cudaFreeHost(b->error_host);
}

int64_t live_backgrounds() {
  std::lock_guard<std::mutex> lock(bg_mu);
  return static_cast<int64_t>(backgrounds().size());
}

bool background_error(int64_t id) {
  Background* b = find_background(id);
  if (!b) throw std::invalid_argument("no background with id " + std::to_string(id));
  return *reinterpret_cast<volatile int32_t*>(b->error_host) != 0;
}

void set_background_yield(int64_t id, int32_t mask) {
  if (mask < 0 || mask > (kYieldFills | kYieldCpu))
    throw std::invalid_argument("background yield mask must be in [0, 3], got " + std::to_string(mask));
  std::lock_guard<std::mutex> lock(bg_mu);  // read by the next fork (under the same lock)
  auto it = backgrounds().find(id);
  if (it == backgrounds().end()) throw std::invalid_argument("no background with id " + std::to_string(id));
  it->second->yield_mask = mask;
}

int32_t background_yield(int64_t id) {
  std::lock_guard<std::mutex> lock(bg_mu);
  auto it = backgrounds().find(id);
  if (it == backgrounds().end()) throw std::invalid_argument("no background with id " + std::to_string(id));
  return it->second->yield_mask;
}

void clear_background_error(int64_t id) {
  Background* b = find_background(id);
  if (!b) throw std::invalid_argument("no background with id " + std::to_string(id));
  *reinterpret_cast<volatile int32_t*>(b->error_host) = 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxBgWait, BgWaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("bg")
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("timeout_ms"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxBgFork, BgForkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<uint64_t>("pool")
                                  .Attr<int64_t>("bg")
                                  .Attr<int64_t>("blocks"));

void* bg_wait_handler() { return reinterpret_cast<void*>(FtjaxBgWait); }
void* bg_fork_handler() { return reinterpret_cast<void*>(FtjaxBgFork); }

}  // namespace ftjax
