// expert_fill (platform CUDA): one launch copies, for both banks at once, the first n_valid
// entries of a device-side (flat id -> cache slot) list from the mapped host pool into the GPU
// cache arrays (aliased in place). n_valid is read on the device, so the call needs no host sync
// and replays correctly inside command buffers; blocks of entries past n_valid exit at once.
#include <algorithm>
#include <map>
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

// Grid (blocks per entry, capacity): entry blockIdx.y, if valid, by gridDim.x blocks.
// `words` (nullptr: not counted): the transfer words; a block with an entry counts itself in while it copies.
__global__ void fill_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ slots,
                            const int32_t* __restrict__ n_valid, int64_t n_experts, int64_t n_slots,
                            const uint4* __restrict__ src0, uint4* __restrict__ dst0, int64_t row0,
                            const uint4* __restrict__ src1, uint4* __restrict__ dst1, int64_t row1, int32_t* words,
                            DownT dt) {
  const int q = blockIdx.y;
  if (q >= *n_valid) return;
  const int64_t id = ids[q], slot = slots[q];
  if (id < 0 || id >= n_experts || slot < 0 || slot >= n_slots) return;  // masked entry
  fill_block_enter(words);
  copy_expert(id, slot, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
              static_cast<int64_t>(gridDim.x) * blockDim.x, src0, dst0, row0, src1, dst1, row1, nullptr, dt);
  fill_block_leave(words);
}

// Units [0, u) of a unit fill (`units` a device scalar, per16 elements per 16 bytes), or whole experts (`units`
// nullptr).
struct UnitsArg {
  const int32_t* units = nullptr;
  int64_t hidden = 0, inter = 0, per16 = 0;
};

// A fixed grid that walks the valid entries one after the other (a few blocks beside other work).
__global__ void fill_loop_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ slots,
                                 const int32_t* __restrict__ n_valid, int64_t capacity, int64_t n_experts,
                                 int64_t n_slots, const uint4* __restrict__ src0, uint4* __restrict__ dst0,
                                 int64_t row0, const uint4* __restrict__ src1, uint4* __restrict__ dst1,
                                 int64_t row1, int32_t* words, DownT dt, UnitsArg ua) {
  const int64_t n = min(static_cast<int64_t>(*n_valid), capacity);
  const int64_t u = ua.units ? min(max(static_cast<int64_t>(*ua.units), int64_t{0}), ua.inter) / 8 * 8 : 0;
  if (n <= 0 || (ua.units && u == 0)) return;
  const int64_t worker = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t workers = static_cast<int64_t>(gridDim.x) * blockDim.x;
  fill_block_enter(words);
  for (int64_t q = 0; q < n; ++q) {
    const int64_t id = ids[q], slot = slots[q];
    if (id < 0 || id >= n_experts || slot < 0 || slot >= n_slots) continue;  // masked entry
    if (ua.units)
      copy_units(id, slot, 0, u, worker, workers, ua.hidden, ua.inter, ua.per16, src0, dst0, row0, src1, dst1, row1,
                 nullptr, dt);
    else
      copy_expert(id, slot, worker, workers, src0, dst0, row0, src1, dst1, row1, nullptr, dt);
  }
  fill_block_leave(words);
}

// bf16 / f32 pools, the unit split: units [0, u) of each valid entry's expert, u = *units (a multiple
// of 8 from the plan): gate rows [0, u) and up rows [I, I + u) of gate_up ([2I, H] per expert, one range
// each) and columns [0, u) of every row of down ([H, I]); the rest of the slot is left as it is (the
// step's background fill completes it). 16-byte units of `per16` elements (8 bf16, 4 f32).
__global__ void fill_units_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ slots,
                                  const int32_t* __restrict__ n_valid, const int32_t* __restrict__ units,
                                  int64_t n_experts, int64_t n_slots, int64_t hidden, int64_t inter, int64_t per16,
                                  const uint4* __restrict__ src0, uint4* __restrict__ dst0, int64_t row0,
                                  const uint4* __restrict__ src1, uint4* __restrict__ dst1, int64_t row1,
                                  int32_t* words, DownT dt) {
  const int q = blockIdx.y;
  if (q >= *n_valid) return;
  const int64_t id = ids[q], slot = slots[q];
  if (id < 0 || id >= n_experts || slot < 0 || slot >= n_slots) return;  // masked entry
  const int64_t u = min(max(static_cast<int64_t>(*units), int64_t{0}), inter) / 8 * 8;
  if (u == 0) return;
  fill_block_enter(words);
  copy_units(id, slot, 0, u, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
             static_cast<int64_t>(gridDim.x) * blockDim.x, hidden, inter, per16, src0, dst0, row0, src1, dst1, row1,
             nullptr, dt);
  fill_block_leave(words);
}

}  // namespace

void launch_fill_units(cudaStream_t stream, const ExpertPool& pool, const int32_t* ids, const int32_t* slots,
                       const int32_t* n_valid, const int32_t* units, int64_t capacity, int64_t n_slots,
                       void* cache_gate_up, void* cache_down, int32_t* words, int64_t max_blocks) {
  const Bank& g = pool.gate_up();
  const Bank& d = pool.down();
  if (!pool.pinned() || !g.device_ptr || !d.device_ptr)
    throw std::invalid_argument("the host pool is not pinned (call HostPool.pin() after loading)");
  if (g.format == WeightFormat::kInt4 || d.format == WeightFormat::kInt4)
    throw std::invalid_argument("the unit fill copies bf16 and f32 pools only (not the packed int4 layout)");
  const int64_t per16 = g.format == WeightFormat::kBF16 ? 8 : 4;
  if (pool.hidden() % 8 || pool.inter() % 8)
    throw std::invalid_argument("the unit fill needs hidden and inter to be multiples of 8");
  if (max_blocks < 0) throw std::invalid_argument("max_blocks must be >= 0 (0: enough to fill the GPU)");
  const DownT dt = down_t_of(pool);
  if (capacity == 0) return;
  const int64_t row0 = g.expert_bytes / 16, row1 = d.expert_bytes / 16;
  if (max_blocks > 0) {  // `max_blocks` in all, walking the valid entries: leaves SMs to the work beside it
    fill_loop_kernel<<<static_cast<unsigned>(max_blocks), kFillThreads, 0, stream>>>(
        ids, slots, n_valid, capacity, pool.n_experts(), n_slots, static_cast<const uint4*>(g.device_ptr),
        static_cast<uint4*>(cache_gate_up), row0, static_cast<const uint4*>(d.device_ptr),
        static_cast<uint4*>(cache_down), row1, words, dt, UnitsArg{units, pool.hidden(), pool.inter(), per16});
    cuda_check(cudaGetLastError(), "expert_fill_units launch");
    return;
  }
  const int64_t per_row = std::max<int64_t>(1, std::min<int64_t>((row0 + row1 + kFillThreads - 1) / kFillThreads,
                                                                 (1056 + capacity - 1) / capacity));
  const dim3 grid(static_cast<unsigned>(per_row), static_cast<unsigned>(capacity));
  fill_units_kernel<<<grid, kFillThreads, 0, stream>>>(
      ids, slots, n_valid, units, pool.n_experts(), n_slots, pool.hidden(), pool.inter(), per16,
      static_cast<const uint4*>(g.device_ptr), static_cast<uint4*>(cache_gate_up), row0,
      static_cast<const uint4*>(d.device_ptr), static_cast<uint4*>(cache_down), row1, words, dt);
  cuda_check(cudaGetLastError(), "expert_fill_units launch");
}

void launch_fill(cudaStream_t stream, const ExpertPool& pool, const int32_t* ids, const int32_t* slots,
                 const int32_t* n_valid, int64_t capacity, int64_t n_slots, void* cache_gate_up, void* cache_down,
                 int64_t max_blocks, int32_t* words) {
  const Bank& g = pool.gate_up();
  const Bank& d = pool.down();
  if (!pool.pinned() || !g.device_ptr || !d.device_ptr)
    throw std::invalid_argument("the host pool is not pinned (call HostPool.pin() after loading)");
  if (g.expert_bytes % 16 || d.expert_bytes % 16)
    throw std::invalid_argument("expert rows must be multiples of 16 bytes for the fill kernel");
  if (max_blocks < 0) throw std::invalid_argument("max_blocks must be >= 0 (0: enough to fill the GPU)");
  const DownT dt = down_t_of(pool);
  if (capacity == 0) return;
  const int64_t row0 = g.expert_bytes / 16, row1 = d.expert_bytes / 16;
  const auto* src0 = static_cast<const uint4*>(g.device_ptr);
  const auto* src1 = static_cast<const uint4*>(d.device_ptr);
  auto* dst0 = static_cast<uint4*>(cache_gate_up);
  auto* dst1 = static_cast<uint4*>(cache_down);
  if (max_blocks > 0) {  // `max_blocks` in all, walking the valid entries: leaves SMs to the work beside it
    fill_loop_kernel<<<static_cast<unsigned>(max_blocks), kFillThreads, 0, stream>>>(
        ids, slots, n_valid, capacity, pool.n_experts(), n_slots, src0, dst0, row0, src1, dst1, row1, words, dt,
        UnitsArg{});
  } else {  // enough blocks per entry to fill the GPU when the list is short (1,056 = 132 SMs x 8 blocks)
    const int64_t per_row = std::max<int64_t>(1, std::min<int64_t>((row0 + row1 + kFillThreads - 1) / kFillThreads,
                                                                   (1056 + capacity - 1) / capacity));
    const dim3 grid(static_cast<unsigned>(per_row), static_cast<unsigned>(capacity));
    fill_kernel<<<grid, kFillThreads, 0, stream>>>(ids, slots, n_valid, pool.n_experts(), n_slots, src0, dst0, row0,
                                               src1, dst1, row1, words, dt);
  }
  cuda_check(cudaGetLastError(), "expert_fill launch");
}

namespace {
// Checks the call and launches the fill on `stream`: XLA's, reading the lists from XLA's buffers, or the
// fork's side stream, reading the fork's private copy `staged` of them; with `units` (the unit split's
// partial fill, a device scalar) launch_fill_units instead.
ffi::Error CheckedFill(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> slots,
                       ffi::Buffer<ffi::S32> n_valid, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                       ffi::Result<ffi::AnyBuffer> gate_up_out, ffi::Result<ffi::AnyBuffer> down_out,
                       uint64_t pool_id, int64_t blocks, const int32_t* staged,
                       const ffi::Buffer<ffi::S32>* units = nullptr) {
  const std::string what = units ? "expert_fill_units: " : "expert_fill: ";
  auto pool = find_pool(pool_id);
  if (!pool) return ffi::Error::InvalidArgument(what + "no host pool with id " + std::to_string(pool_id));
  const int64_t cap = static_cast<int64_t>(ids.element_count());
  if (static_cast<int64_t>(slots.element_count()) != cap || n_valid.element_count() != 1 ||
      (units && units->element_count() != 1))
    return ffi::Error::InvalidArgument(what + "ids and slots must have one length, n_valid (and units) be scalars");
  const auto dims = gate_up.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument(what + "caches must be [S, ...]");
  const int64_t S = dims[0];
  if (gate_up.size_bytes() != static_cast<size_t>(S) * pool->gate_up().expert_bytes ||
      down.size_bytes() != static_cast<size_t>(S) * pool->down().expert_bytes)
    return ffi::Error::InvalidArgument(what + "cache sizes do not match S = " + std::to_string(S) +
                                       " slots of the pool's expert rows (gate_up " +
                                       std::to_string(pool->gate_up().expert_bytes) + " B, down " +
                                       std::to_string(pool->down().expert_bytes) + " B)");
  if (gate_up_out->untyped_data() != gate_up.untyped_data() || down_out->untyped_data() != down.untyped_data())
    return ffi::Error::InvalidArgument(what + "the caches must be aliased to the outputs "
                                       "(input_output_aliases) and donated");
  try {
    if (units)
      launch_fill_units(stream, *pool, ids.typed_data(), slots.typed_data(), n_valid.typed_data(),
                        units->typed_data(), cap, S, gate_up.untyped_data(), down.untyped_data(), transfer_words(false));
    else if (staged)  // a forked fill reads its private copy of the lists: [ids (cap) | slots (cap) | n_valid]
      launch_fill(stream, *pool, staged, staged + cap, staged + 2 * cap, cap, S, gate_up.untyped_data(),
                  down.untyped_data(), blocks);
    else
      launch_fill(stream, *pool, ids.typed_data(), slots.typed_data(), n_valid.typed_data(), cap, S,
                  gate_up.untyped_data(), down.untyped_data(), blocks, transfer_words(false));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(what + e.what());
  }
  return ffi::Error::Success();
}

// The unit split's fill: one more operand, the units (a scalar).
ffi::Error ExpertFillUnitsImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> slots,
                               ffi::Buffer<ffi::S32> n_valid, ffi::Buffer<ffi::S32> units, ffi::AnyBuffer gate_up,
                               ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> gate_up_out,
                               ffi::Result<ffi::AnyBuffer> down_out, uint64_t pool_id) {
  return CheckedFill(stream, ids, slots, n_valid, gate_up, down, gate_up_out, down_out, pool_id, 0, nullptr, &units);
}

// The FFI handler: the lists are XLA's buffers, read on XLA's stream.
ffi::Error ExpertFillImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> slots,
                          ffi::Buffer<ffi::S32> n_valid, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                          ffi::Result<ffi::AnyBuffer> gate_up_out, ffi::Result<ffi::AnyBuffer> down_out,
                          uint64_t pool_id, int64_t blocks) {
  return CheckedFill(stream, ids, slots, n_valid, gate_up, down, gate_up_out, down_out, pool_id, blocks, nullptr);
}

// Fork / join: the fill runs on a side stream, ordered after the work XLA's stream has so far, and XLA's
// stream waits for it only where `ftjax_stream_join` is called for the same lane, so the GPU work issued
// in between can run beside it. One side stream for every lane (fills run in issue order: two forked
// fills never race on a slot), one "done" event per lane (a join waits for its lane's latest fill only,
// not for fills forked after it on other lanes). Outside command buffers only (events across calls do
// not survive graph capture). The fill's outputs are not ready until the join: every reader of the
// filled arrays must take them through the join's output. Made on first use on the current device
// (single GPU).
//
// The fill's lists (ids, slots, count) are XLA temporaries: once the fork's thunk has run, XLA may reuse
// their memory for other values while the forked fill has not started yet (found on the H200: wrong
// rows filled, unless CUDA_LAUNCH_BLOCKING=1). So the fork first copies them, on XLA's stream, into an
// entry of a ring of private device buffers, and the fill reads that copy; before an entry is reused,
// XLA's stream waits for the fill that last read it (kRing fills ago: in practice long done).
constexpr int kRing = 64;
constexpr int64_t kRingInts = 8192;  // per entry: 2 x capacity + 1 int32

__global__ void stage_lists(const int32_t* __restrict__ ids, const int32_t* __restrict__ slots,
                            const int32_t* __restrict__ n_valid, int32_t* __restrict__ dst, int64_t cap) {
  for (int64_t i = threadIdx.x; i < cap; i += blockDim.x) {
    dst[i] = ids[i];
    dst[cap + i] = slots[i];
  }
  if (threadIdx.x == 0) dst[2 * cap] = *n_valid;
}

struct SideStream {
  std::mutex mu;
  cudaStream_t stream = nullptr;
  cudaEvent_t forked = nullptr;
  std::map<int64_t, cudaEvent_t> done;  // per lane
  int32_t* ring = nullptr;              // kRing x kRingInts
  cudaEvent_t ring_done[kRing] = {};    // recorded after the fill that read the entry
  bool ring_used[kRing] = {};
  int next = 0;
};

SideStream& side() {
  static SideStream s;
  return s;
}

void ensure_side(SideStream& s) {  // caller holds s.mu
  if (s.stream) return;
  cuda_check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "fill fork: side stream");
  cuda_check(cudaEventCreateWithFlags(&s.forked, cudaEventDisableTiming), "fill fork: event");
  cuda_check(cudaMalloc(&s.ring, sizeof(int32_t) * kRing * kRingInts), "fill fork: list ring");
  for (auto& ev : s.ring_done) cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "fill fork: ring event");
}

void fork_locked(SideStream& s, cudaStream_t stream) {  // caller holds s.mu; the side stream exists
  cuda_check(cudaEventRecord(s.forked, stream), "fork: record");
  cuda_check(cudaStreamWaitEvent(s.stream, s.forked, 0), "fork: wait");
}

cudaEvent_t lane_done(SideStream& s, int64_t lane) {  // caller holds s.mu
  cudaEvent_t& ev = s.done[lane];
  if (!ev) cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "fork lane event");
  return ev;
}

ffi::Error FillForkImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> slots,
                        ffi::Buffer<ffi::S32> n_valid, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                        ffi::Result<ffi::AnyBuffer> gate_up_out, ffi::Result<ffi::AnyBuffer> down_out,
                        uint64_t pool_id, int64_t blocks, int64_t lane) {
  SideStream& s = side();
  std::lock_guard<std::mutex> lock(s.mu);
  try {
    const int64_t cap = static_cast<int64_t>(ids.element_count());
    if (2 * cap + 1 > kRingInts || static_cast<int64_t>(slots.element_count()) != cap || n_valid.element_count() != 1)
      return ffi::Error::InvalidArgument("expert_fill_fork: ids and slots must have one length, at most " +
                                         std::to_string((kRingInts - 1) / 2) + ", n_valid be a scalar");
    ensure_side(s);
    const int e = s.next;
    s.next = (e + 1) % kRing;
    int32_t* entry = s.ring + static_cast<int64_t>(e) * kRingInts;
    if (s.ring_used[e]) cuda_check(cudaStreamWaitEvent(stream, s.ring_done[e], 0), "fill fork: ring wait");
    s.ring_used[e] = true;
    stage_lists<<<1, 256, 0, stream>>>(ids.typed_data(), slots.typed_data(), n_valid.typed_data(), entry, cap);
    cuda_check(cudaGetLastError(), "fill fork: stage lists");
    cudaEvent_t done = lane_done(s, lane);
    fork_locked(s, stream);
    ffi::Error err = CheckedFill(s.stream, ids, slots, n_valid, gate_up, down, gate_up_out, down_out, pool_id,
                                 blocks, entry);
    if (err.failure()) return err;
    cuda_check(cudaEventRecord(done, s.stream), "fill fork: record done");
    cuda_check(cudaEventRecord(s.ring_done[e], s.stream), "fill fork: record ring");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("expert_fill_fork: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error StreamJoinImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t lane) {
  if (out->untyped_data() != x.untyped_data())
    return ffi::Error::InvalidArgument("stream_join: the operand must be aliased to the output");
  SideStream& s = side();
  std::lock_guard<std::mutex> lock(s.mu);
  try {  // a lane never forked has an event never recorded: the wait is a no-op
    cuda_check(cudaStreamWaitEvent(stream, lane_done(s, lane), 0), "stream join: wait");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("stream_join: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

cudaStream_t side_stream() {
  SideStream& s = side();
  std::lock_guard<std::mutex> lock(s.mu);
  ensure_side(s);
  return s.stream;
}

void fork_to_side(cudaStream_t stream) {
  SideStream& s = side();
  std::lock_guard<std::mutex> lock(s.mu);
  ensure_side(s);
  fork_locked(s, stream);
}

int32_t* transfer_words(bool make) {
  static std::mutex mu;
  static int32_t* words = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (!words && make) {  // outside graph capture: a background's or a channel's creation
    int32_t* w = nullptr;
    cuda_check(cudaMalloc(&w, 2 * sizeof(int32_t)), "transfer words");
    cuda_check(cudaMemset(w, 0, 2 * sizeof(int32_t)), "transfer words");
    cuda_check(cudaDeviceSynchronize(), "transfer words");
    words = w;
  }
  return words;
}

void add_transfer_word(int32_t word, int32_t delta) {
  if (word != kWordFills && word != kWordCpu) throw std::invalid_argument("transfer word must be 0 or 1");
  int32_t* w = transfer_words(true);
  int32_t v = 0;
  cuda_check(cudaMemcpy(&v, w + word, sizeof v, cudaMemcpyDeviceToHost), "transfer word");
  v += delta;
  cuda_check(cudaMemcpy(w + word, &v, sizeof v, cudaMemcpyHostToDevice), "transfer word");
}

int32_t transfer_word(int32_t word) {
  if (word != kWordFills && word != kWordCpu) throw std::invalid_argument("transfer word must be 0 or 1");
  int32_t v = 0;
  cuda_check(cudaMemcpy(&v, transfer_words(true) + word, sizeof v, cudaMemcpyDeviceToHost), "transfer word");
  return v;
}

void sync_side_stream() {
  SideStream& s = side();
  cudaStream_t stream;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    stream = s.stream;
  }
  if (stream) cuda_check(cudaStreamSynchronize(stream), "side stream synchronize");
}

namespace {
#define FTJAX_FILL_BINDING                        \
  ffi::Ffi::Bind()                                \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()   \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::AnyBuffer>()                      \
      .Arg<ffi::AnyBuffer>()                      \
      .Ret<ffi::AnyBuffer>()                      \
      .Ret<ffi::AnyBuffer>()                      \
      .Attr<uint64_t>("pool")                     \
      .Attr<int64_t>("blocks")
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFill, ExpertFillImpl, FTJAX_FILL_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFillNoCmdBuffer, ExpertFillImpl, FTJAX_FILL_BINDING);
#define FTJAX_FILL_UNITS_BINDING                  \
  ffi::Ffi::Bind()                                \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()   \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::Buffer<ffi::S32>>()               \
      .Arg<ffi::AnyBuffer>()                      \
      .Arg<ffi::AnyBuffer>()                      \
      .Ret<ffi::AnyBuffer>()                      \
      .Ret<ffi::AnyBuffer>()                      \
      .Attr<uint64_t>("pool")
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFillUnits, ExpertFillUnitsImpl, FTJAX_FILL_UNITS_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFillUnitsNoCmdBuffer, ExpertFillUnitsImpl, FTJAX_FILL_UNITS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFillFork, FillForkImpl, FTJAX_FILL_BINDING.Attr<int64_t>("lane"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxStreamJoin, StreamJoinImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("lane"));

void* expert_fill_fork_handler() { return reinterpret_cast<void*>(FtjaxExpertFillFork); }
void* stream_join_handler() { return reinterpret_cast<void*>(FtjaxStreamJoin); }

void* expert_fill_units_handler(bool cmd_buffer) {
  return cmd_buffer ? reinterpret_cast<void*>(FtjaxExpertFillUnits)
                    : reinterpret_cast<void*>(FtjaxExpertFillUnitsNoCmdBuffer);
}

void* expert_fill_handler(bool cmd_buffer) {
  return cmd_buffer ? reinterpret_cast<void*>(FtjaxExpertFill) : reinterpret_cast<void*>(FtjaxExpertFillNoCmdBuffer);
}

}  // namespace ftjax
