// The unit split's in-step fill beside the GPU's own expert work (OffloadExperts(fill_beside=True)).
//
// The default decode call fills a split call's units [0, u) into their victim slots (ftjax_expert_fill_units,
// the caches aliased in place) and only then runs the GEMV over every GPU route, the filled ones included: the
// GEMV waits for the PCIe transfer. Here one custom call does the fill and the filled routes' own compute:
//   1. y = 0 ([R, H] f32, one row per route);
//   2. units [0, u) of each valid entry's expert into its slot (copy_units: the same transfer as the default,
//      over a fixed grid of `blocks` blocks that leaves the SMs to the work beside it, or the default grid;
//   3. from the slots just written (HBM), each filled route's gate and up units [0, units[r]) against its
//      token's x (scratch [R, 2I] f32), then its down columns [0, units[r]) against silu(gate) * up: y[r].
// The caches are operands only, not results: to XLA the call reads them, so the GEMV of the other routes
// (route_slot -1 for the filled ones) has no buffer conflict with it and, under XLA's concurrent command-buffer
// scheduling, runs beside the transfer. With `hits` (OffloadExperts(fill_beside_gemv=True)) the call also computes
// every other route with a slot (the hits) itself, on XLA's stream, while the fill runs on a side stream forked and
// joined inside the call: the overlap needs no concurrent scheduling, and the XLA GEMV computes nothing. That is
// sound because the plan never picks a slot used in this step as
// a victim (no route of the step reads what the fill writes), every later reader of the filled slots depends
// on this call's y (the next layers, the next step), and every later writer of the banks (the background
// fork, the next call's background wait, the next fill) is ordered after this call's read of them.
#include <cuda_bf16.h>

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

constexpr int kBesideThreads = 256;
constexpr int kWarps = kBesideThreads / 32;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
// The dtype's own rounding of an intermediate (the jnp path's bf16 einsum outputs and activation).
__device__ __forceinline__ float round_as(float v, float) { return v; }
__device__ __forceinline__ float round_as(float v, __nv_bfloat16) { return __bfloat162float(__float2bfloat16(v)); }

// Entry q of the fill list, if valid: its slot (else -1).
__device__ __forceinline__ int64_t entry_slot(const int32_t* ids, const int32_t* slots, const int32_t* n_valid,
                                              int64_t capacity, int64_t q, int64_t n_experts, int64_t n_slots) {
  if (q >= min(static_cast<int64_t>(*n_valid), capacity)) return -1;
  const int64_t id = ids[q], slot = slots[q];
  return (id < 0 || id >= n_experts || slot < 0 || slot >= n_slots) ? -1 : slot;
}

// The dot of 16 bytes of weights and 16 bytes of x (8 bf16 or 4 f32 each).
__device__ __forceinline__ float dot16(uint4 w, uint4 x, float) {
  return __uint_as_float(w.x) * __uint_as_float(x.x) + __uint_as_float(w.y) * __uint_as_float(x.y) +
         __uint_as_float(w.z) * __uint_as_float(x.z) + __uint_as_float(w.w) * __uint_as_float(x.w);
}
__device__ __forceinline__ float dot16(uint4 w, uint4 x, __nv_bfloat16) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w}, xs[4] = {x.x, x.y, x.z, x.w};
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[i]));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xs[i]));
    acc += a.x * b.x + a.y * b.y;
  }
  return acc;
}

// The dot of 16 bytes of down weights (8 bf16 or 4 f32) and the activations act[0, 8 or 4) (shared memory, 16-byte
// aligned).
__device__ __forceinline__ float dot16_act(uint4 w, const float* act, float) {
  const float4 a = *reinterpret_cast<const float4*>(act);
  return __uint_as_float(w.x) * a.x + __uint_as_float(w.y) * a.y + __uint_as_float(w.z) * a.z +
         __uint_as_float(w.w) * a.w;
}
__device__ __forceinline__ float dot16_act(uint4 w, const float* act, __nv_bfloat16) {
  const float4 a0 = *reinterpret_cast<const float4*>(act), a1 = *reinterpret_cast<const float4*>(act + 4);
  const float2 w0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
  const float2 w1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
  const float2 w2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.z));
  const float2 w3 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.w));
  return w0.x * a0.x + w0.y * a0.y + w1.x * a0.z + w1.y * a0.w + w2.x * a1.x + w2.y * a1.y + w3.x * a1.z +
         w3.y * a1.w;
}

// One lane's part of the dot of a down row's units [0, u) and act: 16-byte weight loads (a whole 512-unit bf16 row is
// two per lane, all in flight) when the rows start on 16 bytes (`vec`: I a multiple of 16 / sizeof(W)), then the tail
// (and the whole row otherwise) one element per lane.
template <typename W>
__device__ __forceinline__ float down_dot(const W* w, const float* act, int64_t u, bool vec, int lane) {
  constexpr int64_t kPer = 16 / sizeof(W);
  const int64_t n16 = vec ? u / kPer : 0;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  float acc = 0.f;
#pragma unroll 2
  for (int64_t i = lane; i < n16; i += 32) acc += dot16_act(wv[i], act + i * kPer, W{});
  for (int64_t j = n16 * kPer + lane; j < u; j += 32) acc += to_f(w[j]) * act[j];
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Whether `slot` is a valid entry's of the fill list (the beside call computes its routes after the fill).
__device__ __forceinline__ bool is_filled(const int32_t* ids, const int32_t* slots, const int32_t* n_valid,
                                          int64_t capacity, int64_t slot, int64_t n_experts, int64_t n_slots) {
  for (int64_t q = 0; q < capacity; ++q)
    if (entry_slot(ids, slots, n_valid, capacity, q, n_experts, n_slots) == slot) return true;
  return false;
}

struct Compute {
  const int32_t *ids, *slots, *n_valid, *route_slot, *route_units;
  int64_t capacity, n_experts, n_slots, routes, k, hidden, inter;
  float* scratch;  // [R, 2I]: gate units [0, I), up units [I, 2I)
  float* y;        // [R, H]
};

// The slot block row blockIdx.y computes from (-1: none) and its routes [r0, r1) (those of them in the slot). Filled
// (kHits false): entry blockIdx.y's slot, every route. Hits: route q = blockIdx.y's slot if it is valid, not being
// filled and no earlier route's (that one's block row computes it), routes [q, R): an expert's weights are read once
// per call however many tokens route to it.
template <bool kHits>
__device__ __forceinline__ int64_t block_slot(const Compute& c, int64_t& r0, int64_t& r1) {
  const int64_t q = blockIdx.y;
  r1 = c.routes;
  if (!kHits) {
    r0 = 0;
    return entry_slot(c.ids, c.slots, c.n_valid, c.capacity, q, c.n_experts, c.n_slots);
  }
  r0 = q;
  const int64_t slot = c.route_slot[q];
  if (slot < 0 || slot >= c.n_slots || is_filled(c.ids, c.slots, c.n_valid, c.capacity, slot, c.n_experts, c.n_slots))
    return -1;
  for (int64_t r = 0; r < q; ++r)
    if (c.route_slot[r] == slot) return -1;
  return slot;
}

// Grid (ceil(2I / kWarps), capacity or routes): a warp per gate or up row of the block row's slot, against the x of
// each of its routes (a slot is one expert of one layer: its routes are distinct tokens).
template <typename W, bool kHits>
__global__ void routes_gate_up(Compute c, const W* __restrict__ x, const W* __restrict__ gate_up) {
  int64_t r0, r1;
  const int64_t slot = block_slot<kHits>(c, r0, r1);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (slot < 0 || row >= 2 * c.inter) return;
  const int lane = threadIdx.x % 32;
  const int64_t unit = row < c.inter ? row : row - c.inter;
  // 16-byte vectors (hidden is a multiple of 8: every row starts on one), 4 loads in flight per lane
  const int64_t n16 = c.hidden * static_cast<int64_t>(sizeof(W)) / 16;
  const uint4* w = reinterpret_cast<const uint4*>(gate_up + (slot * 2 * c.inter + row) * c.hidden);
  for (int64_t r = r0; r < r1; ++r) {
    if (c.route_slot[r] != slot || unit >= c.route_units[r]) continue;
    const uint4* xt = reinterpret_cast<const uint4*>(x + (r / c.k) * c.hidden);
    float acc = 0.f;
#pragma unroll 4
    for (int64_t i = lane; i < n16; i += 32) acc += dot16(w[i], xt[i], W{});
    acc = warp_sum(acc);
    if (lane == 0) c.scratch[r * 2 * c.inter + row] = round_as(acc, W{});
  }
}

// Grid (ceil(H / kWarps), capacity or routes): per route of the block row's slot, silu(gate) * up of its units
// into shared memory, then a warp per down row: y[r][h] = sum over units j < units[r] of down[h][j] * act[j].
template <typename W, bool kHits>
__global__ void routes_down(Compute c, const W* __restrict__ down) {
  extern __shared__ __align__(16) float act[];  // [I]
  int64_t r0, r1;
  const int64_t slot = block_slot<kHits>(c, r0, r1);
  if (slot < 0) return;
  const int64_t h = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool vec = c.inter % (16 / static_cast<int64_t>(sizeof(W))) == 0;
  for (int64_t r = r0; r < r1; ++r) {
    if (c.route_slot[r] != slot) continue;  // (block-uniform)
    const int64_t u = min(static_cast<int64_t>(c.route_units[r]), c.inter);
    __syncthreads();  // the previous route's act is no longer read
    for (int64_t j = threadIdx.x; j < u; j += blockDim.x) {
      const float g = c.scratch[r * 2 * c.inter + j], up = c.scratch[r * 2 * c.inter + c.inter + j];
      act[j] = round_as(g / (1.f + expf(-g)) * up, W{});
    }
    __syncthreads();
    if (h >= c.hidden) continue;
    const float acc = warp_sum(down_dot(down + (slot * c.hidden + h) * c.inter, act, u, vec, lane));
    if (lane == 0) c.y[r * c.hidden + h] = acc;
  }
}

// The side stream the fill runs on under `hits`, and the fork / join events (made once, before any capture:
// prepare_fill_beside from Python when the call is traced). One per process: XLA runs a device's calls in order.
// Not side_stream() (ffi_cuda.cu): that one carries the background fills, which the in-step fill must not queue
// behind.
struct BesideStream {
  std::mutex mu;
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

BesideStream& beside_stream() {
  static BesideStream s;
  return s;
}

template <typename W, bool kHits>
void launch_routes(cudaStream_t stream, const Compute& c, const void* x, const void* gate_up, const void* down,
                   unsigned rows) {
  const dim3 grid_gu(static_cast<unsigned>((2 * c.inter + kWarps - 1) / kWarps), rows);
  const dim3 grid_dn(static_cast<unsigned>((c.hidden + kWarps - 1) / kWarps), rows);
  routes_gate_up<W, kHits><<<grid_gu, kBesideThreads, 0, stream>>>(c, static_cast<const W*>(x),
                                                                     static_cast<const W*>(gate_up));
  routes_down<W, kHits><<<grid_dn, kBesideThreads, sizeof(float) * c.inter, stream>>>(c, static_cast<const W*>(down));
}

template <bool kHits>
void launch_routes(cudaStream_t stream, bool bf16, const Compute& c, const void* x, const void* gate_up,
                   const void* down, unsigned rows) {
  if (bf16)
    launch_routes<__nv_bfloat16, kHits>(stream, c, x, gate_up, down, rows);
  else
    launch_routes<float, kHits>(stream, c, x, gate_up, down, rows);
}

}  // namespace

void prepare_fill_beside() {
  BesideStream& s = beside_stream();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.stream) return;
  cuda_check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "fill beside: side stream");
  cuda_check(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming), "fill beside: fork event");
  cuda_check(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming), "fill beside: join event");
}

namespace {

ffi::Error FillBesideImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> route_slot,
                          ffi::Buffer<ffi::S32> route_units, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> slots,
                          ffi::Buffer<ffi::S32> n_valid, ffi::Buffer<ffi::S32> units, ffi::AnyBuffer gate_up,
                          ffi::AnyBuffer down, ffi::Result<ffi::Buffer<ffi::F32>> y,
                          ffi::Result<ffi::Buffer<ffi::F32>> scratch, uint64_t pool_id, int64_t blocks,
                          int64_t hits) {
  const std::string what = "expert_fill_beside: ";
  auto pool = find_pool(pool_id);
  if (!pool) return ffi::Error::InvalidArgument(what + "no host pool with id " + std::to_string(pool_id));
  const Bank& g = pool->gate_up();
  const Bank& d = pool->down();
  if (g.format == WeightFormat::kInt4 || d.format == WeightFormat::kInt4)
    return ffi::Error::InvalidArgument(what + "bf16 and f32 pools only (not the packed int4 layout)");
  const bool bf16 = g.format == WeightFormat::kBF16;
  const ffi::DataType want = bf16 ? ffi::DataType::BF16 : ffi::DataType::F32;
  if (x.element_type() != want || gate_up.element_type() != want || down.element_type() != want)
    return ffi::Error::InvalidArgument(what + "x and the caches must have the pool's dtype (" +
                                       (bf16 ? "bf16" : "f32") + ")");
  const int64_t H = pool->hidden(), I = pool->inter();
  const auto xd = x.dimensions();
  const int64_t R = static_cast<int64_t>(route_slot.element_count());
  if (xd.size() != 2 || xd[1] != H || xd[0] < 1 || R % xd[0] != 0 ||
      static_cast<int64_t>(route_units.element_count()) != R)
    return ffi::Error::InvalidArgument(what + "x must be [T, H], route_slot and route_units [T * k]");
  const int64_t cap = static_cast<int64_t>(ids.element_count());
  if (static_cast<int64_t>(slots.element_count()) != cap || n_valid.element_count() != 1 ||
      units.element_count() != 1)
    return ffi::Error::InvalidArgument(what + "ids and slots must have one length, n_valid and units be scalars");
  const auto cd = gate_up.dimensions();
  if (cd.size() < 1) return ffi::Error::InvalidArgument(what + "caches must be [S, ...]");
  const int64_t S = cd[0];
  if (gate_up.size_bytes() != static_cast<size_t>(S) * g.expert_bytes ||
      down.size_bytes() != static_cast<size_t>(S) * d.expert_bytes)
    return ffi::Error::InvalidArgument(what + "cache sizes do not match S = " + std::to_string(S) +
                                       " slots of the pool's expert rows");
  if (static_cast<int64_t>(y->element_count()) != R * H || static_cast<int64_t>(scratch->element_count()) != R * 2 * I)
    return ffi::Error::InvalidArgument(what + "y must be [R, H] and scratch [R, 2I] f32");
  if (blocks < 0) return ffi::Error::InvalidArgument(what + "blocks must be >= 0 (0: the default fill's grid)");
  if (hits != 0 && hits != 1) return ffi::Error::InvalidArgument(what + "hits must be 0 or 1");
  BesideStream& side = beside_stream();
  try {
    cuda_check(cudaMemsetAsync(y->typed_data(), 0, sizeof(float) * R * H, stream), "expert_fill_beside memset");
    const Compute c{ids.typed_data(), slots.typed_data(), n_valid.typed_data(), route_slot.typed_data(),
                    route_units.typed_data(), cap, pool->n_experts(), S, R, R / xd[0], H, I,
                    scratch->typed_data(), y->typed_data()};
    const void *xp = x.untyped_data(), *gp = gate_up.untyped_data(), *dp = down.untyped_data();
    if (hits) {  // the fill on the side stream, the hits here meanwhile, then (joined) the filled routes
      std::lock_guard<std::mutex> lock(side.mu);
      if (!side.stream)
        return ffi::Error::Internal(what + "hits needs prepare_fill_beside() first (before any capture)");
      cuda_check(cudaEventRecord(side.fork, stream), "expert_fill_beside fork");
      cuda_check(cudaStreamWaitEvent(side.stream, side.fork, 0), "expert_fill_beside fork wait");
      if (cap > 0)
        launch_fill_units(side.stream, *pool, ids.typed_data(), slots.typed_data(), n_valid.typed_data(),
                          units.typed_data(), cap, S, gate_up.untyped_data(), down.untyped_data(),
                          transfer_words(false), blocks);
      cuda_check(cudaEventRecord(side.join, side.stream), "expert_fill_beside join");
      if (R > 0) launch_routes<true>(stream, bf16, c, xp, gp, dp, static_cast<unsigned>(R));
      cuda_check(cudaStreamWaitEvent(stream, side.join, 0), "expert_fill_beside join wait");
    } else {
      if (cap == 0) return ffi::Error::Success();
      launch_fill_units(stream, *pool, ids.typed_data(), slots.typed_data(), n_valid.typed_data(), units.typed_data(),
                        cap, S, gate_up.untyped_data(), down.untyped_data(), transfer_words(false), blocks);
    }
    if (cap > 0) launch_routes<false>(stream, bf16, c, xp, gp, dp, static_cast<unsigned>(cap));
    cuda_check(cudaGetLastError(), "expert_fill_beside compute launch");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(what + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFillBeside, FillBesideImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x [T, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()      // route_slot [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()      // route_units [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()      // fill ids [F]
                                  .Arg<ffi::Buffer<ffi::S32>>()      // fill slots [F]
                                  .Arg<ffi::Buffer<ffi::S32>>()      // n_fill []
                                  .Arg<ffi::Buffer<ffi::S32>>()      // fill units []
                                  .Arg<ffi::AnyBuffer>()             // gate_up cache (written, not a result)
                                  .Arg<ffi::AnyBuffer>()             // down cache (written, not a result)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // y [R, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scratch [R, 2I]
                                  .Attr<uint64_t>("pool")
                                  .Attr<int64_t>("blocks")
                                  .Attr<int64_t>("hits"),
                              {ffi::Traits::kCmdBufferCompatible});

void* expert_fill_beside_handler() { return reinterpret_cast<void*>(FtjaxExpertFillBeside); }

}  // namespace ftjax
