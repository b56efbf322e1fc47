// The prefill route plan on the GPU (ftjax/pallas/route_tables.py): the tables the grouped expert kernels
// read, from the router's expert ids, in three launches of one FFI call. XLA's form of the same plan
// (routing.plan_routes + tile_walk) is ~28 small kernels per prefill call on the H200 (a radix sort,
// scatters, cumsums, searches: ~80 us of work and a launch gap each at 8K tokens, session 20). One thread
// block doing all of it took 124 us at 8K (session 21: 65,536 scattered stores and the ranking chains on
// one SM), so the routes are spread over a grid:
//   1. count: block b counts its contiguous chunk of routes per expert (and zeroes the input-row table);
//   2. layout (one block): per expert, each block's first rank (an exclusive sum over the blocks), the
//      group sizes, the padded and the input-row group starts, the row-tile tables and the tile walks;
//   3. rank: block b ranks its routes 32 at a time per warp, in route order (lanes of one expert by a
//      match vote), and writes each route's padded row and its input row's token.
// Stable, like the jnp plan: route r's rank within its expert's group is the number of earlier routes (in
// flat order t * k + j) of that expert.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ffi_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kRankThreads = 256;
constexpr int kRankWarps = kRankThreads / 32;
constexpr int kUnroll = 4;  // route loads a lane keeps in flight
constexpr int64_t kMaxExperts = 1024;  // route_tables.CUDA_MAX_EXPERTS
constexpr int64_t kMaxBlocks = 256;    // route_tables.MAX_BLOCKS
constexpr int kInputAlign = 8;  // rows: each group's first row in the input buffer (routing.INPUT_ALIGN)

struct TablesArgs {
  const int32_t* ids;             // [R] flat routes t * k + j
  const bool* valid;              // [T] per token, or [R] per route
  const int32_t* slot_of_expert;  // [E]
  int32_t routes, top_k, n_experts, tile, num_rows, in_rows, n_slots, blocks, chunk;
  bool valid_per_route;
  int32_t* scratch;             // [blocks * E] counts, then first ranks; [E] padded starts; [E] input starts
  int32_t* row_of_route;        // [R] padded row of each route; num_rows where the route is dropped
  int32_t* token_of_input_row;  // [in_rows] token of each input-buffer row (0 for padding and spare rows)
  int32_t* tile_slot;           // [num_rows / tile] cache slot of each row tile's expert
  int32_t* tile_row0;           // [num_rows / tile] input row of each row tile's first row (0 if idle)
  int32_t* tile_rows;           // [num_rows / tile] rows of each row tile that hold routes
  int32_t* n_launch;            // [1] max(row tiles in use, 1)
  int32_t* walk[2];             // [num_rows / tile * walk_blocks] or nullptr (routing.tile_walk)
  int32_t walk_blocks[2], walk_band[2];
};

__device__ __forceinline__ int32_t round_up(int32_t v, int32_t m) { return (v + m - 1) / m * m; }

// A route whose token is invalid, or whose expert id is out of range, belongs to no group.
__device__ __forceinline__ bool route_ok(const TablesArgs& a, int32_t r, int32_t e) {
  const bool v = a.valid_per_route ? a.valid[r] : a.valid[r / a.top_k];
  return v && e >= 0 && e < a.n_experts;
}

// Routes [lo, hi) a lane visits kUnroll x 32 at a time: f(r, e, ok) for each, in route order per lane.
template <class F>
__device__ __forceinline__ void each_route(const TablesArgs& a, int32_t lo, int32_t hi, int lane, F f) {
  for (int32_t b = lo; b < hi; b += 32 * kUnroll) {
    int32_t e[kUnroll];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t r = b + u * 32 + lane;
      e[u] = r < hi ? a.ids[r] : -1;
      ok[u] = r < hi && route_ok(a, r, e[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) f(b + u * 32 + lane, e[u], ok[u]);
  }
}

__device__ __forceinline__ int32_t block_lo(const TablesArgs& a, int b) { return min(a.routes, b * a.chunk); }

// 1. Block b's routes per expert into scratch[b * E ..]; the input-row table zeroed, grid-strided.
__global__ void __launch_bounds__(kRankThreads) count_kernel(TablesArgs a) {
  extern __shared__ int32_t hist[];  // [E]
  const int E = a.n_experts, tid = threadIdx.x;
  for (int e = tid; e < E; e += kRankThreads) hist[e] = 0;
  const bool aligned = (reinterpret_cast<uintptr_t>(a.token_of_input_row) & 15) == 0;
  const int32_t quads = aligned ? a.in_rows / 4 : 0, stride = a.blocks * kRankThreads;
  int4* q = reinterpret_cast<int4*>(a.token_of_input_row);
  for (int32_t i = blockIdx.x * kRankThreads + tid; i < quads; i += stride) q[i] = make_int4(0, 0, 0, 0);
  for (int32_t i = quads * 4 + blockIdx.x * kRankThreads + tid; i < a.in_rows; i += stride)
    a.token_of_input_row[i] = 0;
  __syncthreads();
  const int32_t lo = block_lo(a, blockIdx.x), hi = min(a.routes, lo + a.chunk);
  const int warp = tid >> 5, lane = tid & 31;
  const int32_t sub = (hi - lo + kRankWarps - 1) / kRankWarps;  // each warp a contiguous part
  const int32_t wlo = min(hi, lo + warp * sub), whi = min(hi, wlo + sub);
  each_route(a, wlo, whi, lane, [&](int32_t, int32_t e, bool ok) {
    if (ok) atomicAdd(&hist[e], 1);
  });
  __syncthreads();
  for (int e = tid; e < E; e += kRankThreads) a.scratch[blockIdx.x * E + e] = hist[e];
}

// Exclusive scans over the experts of the group sizes padded to `tile` and to kInputAlign rows, each
// thread a contiguous run of experts; returns both totals (every thread).
__device__ int2 scan_group_starts(const TablesArgs& a, const int32_t* sizes, int32_t* pstart, int32_t* istart) {
  constexpr int kWarps = kLayoutThreads / 32;
  __shared__ int32_t warp_sum[2][kWarps];
  const int E = a.n_experts, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (E + kLayoutThreads - 1) / kLayoutThreads;
  const int s0 = min(E, tid * per), s1 = min(E, s0 + per);
  int32_t own_p = 0, own_i = 0;
  for (int e = s0; e < s1; ++e) {
    own_p += round_up(sizes[e], a.tile);
    own_i += round_up(sizes[e], kInputAlign);
  }
  int32_t inc_p = own_p, inc_i = own_i;
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t up_p = __shfl_up_sync(0xffffffffu, inc_p, o), up_i = __shfl_up_sync(0xffffffffu, inc_i, o);
    if (lane >= o) inc_p += up_p, inc_i += up_i;
  }
  if (lane == 31) warp_sum[0][warp] = inc_p, warp_sum[1][warp] = inc_i;
  __syncthreads();
  if (warp == 0) {
    int32_t p = warp_sum[0][lane], i = warp_sum[1][lane];
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t up_p = __shfl_up_sync(0xffffffffu, p, o), up_i = __shfl_up_sync(0xffffffffu, i, o);
      if (lane >= o) p += up_p, i += up_i;
    }
    warp_sum[0][lane] = p, warp_sum[1][lane] = i;  // inclusive over warps
  }
  __syncthreads();
  int32_t at_p = inc_p - own_p + (warp ? warp_sum[0][warp - 1] : 0);
  int32_t at_i = inc_i - own_i + (warp ? warp_sum[1][warp - 1] : 0);
  for (int e = s0; e < s1; ++e) {
    pstart[e] = at_p, istart[e] = at_i;
    at_p += round_up(sizes[e], a.tile);
    at_i += round_up(sizes[e], kInputAlign);
  }
  return make_int2(warp_sum[0][kWarps - 1], warp_sum[1][kWarps - 1]);
}

// Row tile m's tables (the jnp plan's tile_group / tile_row0 / tile_rows, the slot, the walks).
__device__ void tile_tables(const TablesArgs& a, int32_t m, int32_t total, const int32_t* sizes,
                            const int32_t* pstart, const int32_t* istart) {
  const int32_t first = m * a.tile;
  int lo = 0, hi = a.n_experts;  // the first group whose padded end is past `first`
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (pstart[mid] + round_up(sizes[mid], a.tile) <= first) lo = mid + 1; else hi = mid;
  }
  const int g = min(lo, a.n_experts - 1);
  const bool active = first < total;
  const int32_t in_group = first - pstart[g];
  a.tile_row0[m] = active ? istart[g] + in_group : 0;
  a.tile_rows[m] = active ? min(max(sizes[g] - in_group, 0), a.tile) : 0;
  a.tile_slot[m] = min(max(a.slot_of_expert[g], 0), a.n_slots - 1);
  for (int w = 0; w < 2; ++w) {
    int32_t* walk = a.walk[w];
    if (walk == nullptr) continue;
    const int32_t nb = a.walk_blocks[w], band = a.walk_band[w];
    if (!active) {  // idle tiles keep the row-major order
      for (int32_t n = 0; n < nb; ++n) walk[m * nb + n] = m * nb + n;
      continue;
    }
    const int32_t first_tile = pstart[g] / a.tile, count = (sizes[g] + a.tile - 1) / a.tile;
    const int32_t band_first = first_tile + (m - first_tile) / band * band;
    const int32_t band_count = min(band, first_tile + count - band_first);
    for (int32_t n = 0; n < nb; ++n) walk[band_first * nb + n * band_count + (m - band_first)] = m * nb + n;
  }
}

// 2. One block: counts -> each block's first rank per expert; group starts; the row-tile tables.
__global__ void __launch_bounds__(kLayoutThreads, 1) layout_kernel(TablesArgs a) {
  extern __shared__ int32_t smem[];
  const int E = a.n_experts, tid = threadIdx.x;
  int32_t* sizes = smem;        // [E]
  int32_t* pstart = sizes + E;  // [E] first padded row of each group
  int32_t* istart = pstart + E; // [E] first input row of each group
  for (int e = tid; e < E; e += kLayoutThreads) {
    int32_t run = 0;
    for (int b = 0; b < a.blocks; ++b) {
      const int32_t c = a.scratch[b * E + e];
      a.scratch[b * E + e] = run;
      run += c;
    }
    sizes[e] = run;
  }
  __syncthreads();
  const int2 totals = scan_group_starts(a, sizes, pstart, istart);
  __syncthreads();
  int32_t* g_pstart = a.scratch + a.blocks * E;
  for (int e = tid; e < E; e += kLayoutThreads) g_pstart[e] = pstart[e], g_pstart[E + e] = istart[e];
  if (tid == 0) a.n_launch[0] = max(totals.x / a.tile, 1);
  for (int32_t m = tid; m < a.num_rows / a.tile; m += kLayoutThreads) tile_tables(a, m, totals.x, sizes, pstart, istart);
}

// 3. Block b ranks its routes: each warp's first rank per expert, then 32 routes at a time in order.
__global__ void __launch_bounds__(kRankThreads) rank_kernel(TablesArgs a) {
  extern __shared__ int32_t smem[];
  const int E = a.n_experts, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int32_t* next = smem;                       // [kRankWarps][E]: counts, then each warp's next rank
  int32_t* pstart = next + kRankWarps * E;    // [E]
  int32_t* istart = pstart + E;               // [E]
  const int32_t* g_pstart = a.scratch + a.blocks * E;
  for (int i = tid; i < kRankWarps * E; i += kRankThreads) next[i] = 0;
  for (int e = tid; e < E; e += kRankThreads) pstart[e] = g_pstart[e], istart[e] = g_pstart[E + e];
  __syncthreads();
  const int32_t lo = block_lo(a, blockIdx.x), hi = min(a.routes, lo + a.chunk);
  const int32_t sub = (hi - lo + kRankWarps - 1) / kRankWarps;
  const int32_t wlo = min(hi, lo + warp * sub), whi = min(hi, wlo + sub);
  int32_t* mine = next + warp * E;
  each_route(a, wlo, whi, lane, [&](int32_t, int32_t e, bool ok) {
    if (ok) atomicAdd(&mine[e], 1);
  });
  __syncthreads();
  for (int e = tid; e < E; e += kRankThreads) {
    int32_t run = a.scratch[blockIdx.x * E + e];
    for (int w = 0; w < kRankWarps; ++w) {
      const int32_t c = next[w * E + e];
      next[w * E + e] = run;
      run += c;
    }
  }
  __syncthreads();
  const unsigned below = (1u << lane) - 1u;
  each_route(a, wlo, whi, lane, [&](int32_t r, int32_t e, bool ok) {
    const unsigned peers = __match_any_sync(0xffffffffu, ok ? e : -1 - lane);
    const int32_t rank = ok ? mine[e] + __popc(peers & below) : 0;
    __syncwarp();
    if (ok && (peers & below) == 0) mine[e] += __popc(peers);
    __syncwarp();
    if (r >= whi) return;
    if (ok) {
      a.row_of_route[r] = pstart[e] + rank;
      a.token_of_input_row[istart[e] + rank] = r / a.top_k;
    } else {
      a.row_of_route[r] = a.num_rows;
    }
  });
}

std::string tag(const std::string& what) { return "route_tables: " + what; }

ffi::Error RouteTablesImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::PRED> valid,
                           ffi::Buffer<ffi::S32> slot_of_expert, ffi::Result<ffi::Buffer<ffi::S32>> row_of_route,
                           ffi::Result<ffi::Buffer<ffi::S32>> token_of_input_row, ffi::Result<ffi::Buffer<ffi::S32>> tile_slot,
                           ffi::Result<ffi::Buffer<ffi::S32>> tile_row0, ffi::Result<ffi::Buffer<ffi::S32>> tile_rows,
                           ffi::Result<ffi::Buffer<ffi::S32>> n_launch, ffi::Result<ffi::Buffer<ffi::S32>> walk0,
                           ffi::Result<ffi::Buffer<ffi::S32>> walk1, ffi::Result<ffi::Buffer<ffi::S32>> scratch,
                           int64_t top_k, int64_t tile, int64_t num_rows, int64_t n_slots, int64_t valid_per_route,
                           int64_t walk0_blocks, int64_t walk0_band, int64_t walk1_blocks, int64_t walk1_band,
                           int64_t grid) {
  const int64_t R = static_cast<int64_t>(ids.element_count());
  const int64_t E = static_cast<int64_t>(slot_of_expert.element_count());
  if (E < 1 || E > kMaxExperts)
    return ffi::Error::InvalidArgument(tag("1 to " + std::to_string(kMaxExperts) + " experts, got " +
                                           std::to_string(E)));
  if (top_k < 1 || R % top_k != 0 || R >= (int64_t{1} << 30))
    return ffi::Error::InvalidArgument(tag(std::to_string(R) + " routes, top_k " + std::to_string(top_k)));
  if (static_cast<int64_t>(valid.element_count()) != (valid_per_route ? R : R / top_k))
    return ffi::Error::InvalidArgument(tag("valid has " + std::to_string(valid.element_count()) + " entries"));
  if (tile < 1 || num_rows < tile || num_rows % tile != 0 || num_rows >= (int64_t{1} << 30) || n_slots < 1)
    return ffi::Error::InvalidArgument(tag("tile " + std::to_string(tile) + ", rows " + std::to_string(num_rows) +
                                           ", slots " + std::to_string(n_slots)));
  const int64_t n_row_tiles = num_rows / tile;
  const int64_t in_rows = static_cast<int64_t>(token_of_input_row->element_count());
  // the input layout's bound (routing.padded_rows_bound at INPUT_ALIGN) plus a tile of spare rows
  const int64_t in_bound = (R + std::min(E, R) * (kInputAlign - 1)) / kInputAlign * kInputAlign;
  if (static_cast<int64_t>(row_of_route->element_count()) != R || in_rows < in_bound ||
      static_cast<int64_t>(tile_slot->element_count()) != n_row_tiles ||
      static_cast<int64_t>(tile_row0->element_count()) != n_row_tiles ||
      static_cast<int64_t>(tile_rows->element_count()) != n_row_tiles || n_launch->element_count() != 1)
    return ffi::Error::InvalidArgument(tag("result sizes do not match the routes and the row tiles"));
  if (num_rows < (R + std::min(E, R) * (tile - 1)) / tile * tile)
    return ffi::Error::InvalidArgument(tag("num_rows " + std::to_string(num_rows) + " is below the padded bound"));
  if (grid < 1 || grid > kMaxBlocks || static_cast<int64_t>(scratch->element_count()) != (grid + 2) * E)
    return ffi::Error::InvalidArgument(tag("grid " + std::to_string(grid) + " (1 to " + std::to_string(kMaxBlocks) +
                                           ") and a scratch of (grid + 2) * E"));
  TablesArgs a{};
  ffi::Result<ffi::Buffer<ffi::S32>>* walks[2] = {&walk0, &walk1};
  const int64_t blocks[2] = {walk0_blocks, walk1_blocks}, bands[2] = {walk0_band, walk1_band};
  for (int w = 0; w < 2; ++w) {
    if (bands[w] == 0) continue;  // no walk: the result is a placeholder
    if (bands[w] < 1 || blocks[w] < 1 ||
        static_cast<int64_t>((*walks[w])->element_count()) != n_row_tiles * blocks[w])
      return ffi::Error::InvalidArgument(tag("walk " + std::to_string(w) + ": band " + std::to_string(bands[w]) +
                                             ", blocks " + std::to_string(blocks[w])));
    a.walk[w] = (*walks[w])->typed_data();
    a.walk_blocks[w] = static_cast<int32_t>(blocks[w]);
    a.walk_band[w] = static_cast<int32_t>(bands[w]);
  }
  a.ids = ids.typed_data();
  a.valid = valid.typed_data();
  a.slot_of_expert = slot_of_expert.typed_data();
  a.routes = static_cast<int32_t>(R);
  a.top_k = static_cast<int32_t>(top_k);
  a.n_experts = static_cast<int32_t>(E);
  a.tile = static_cast<int32_t>(tile);
  a.num_rows = static_cast<int32_t>(num_rows);
  a.in_rows = static_cast<int32_t>(in_rows);
  a.n_slots = static_cast<int32_t>(std::min<int64_t>(n_slots, INT32_MAX));
  a.valid_per_route = valid_per_route != 0;
  a.row_of_route = row_of_route->typed_data();
  a.token_of_input_row = token_of_input_row->typed_data();
  a.tile_slot = tile_slot->typed_data();
  a.tile_row0 = tile_row0->typed_data();
  a.tile_rows = tile_rows->typed_data();
  a.n_launch = n_launch->typed_data();
  a.scratch = scratch->typed_data();
  a.blocks = static_cast<int32_t>(grid);
  a.chunk = static_cast<int32_t>((R + grid - 1) / grid);
  // shared memory: E, 3 E and 10 E int32 (40 KiB at 1,024 experts: under the 48 KiB default)
  const size_t e_bytes = sizeof(int32_t) * static_cast<size_t>(E);
  count_kernel<<<grid, kRankThreads, e_bytes, stream>>>(a);
  layout_kernel<<<1, kLayoutThreads, 3 * e_bytes, stream>>>(a);
  rank_kernel<<<grid, kRankThreads, (kRankWarps + 2) * e_bytes, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(tag(std::string("launch: ") + cudaGetErrorString(err)));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxRouteTables, RouteTablesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("n_slots")
                                  .Attr<int64_t>("valid_per_route")
                                  .Attr<int64_t>("walk0_blocks")
                                  .Attr<int64_t>("walk0_band")
                                  .Attr<int64_t>("walk1_blocks")
                                  .Attr<int64_t>("walk1_band")
                                  .Attr<int64_t>("grid"),
                              {ffi::Traits::kCmdBufferCompatible});

void* route_tables_handler() { return reinterpret_cast<void*>(FtjaxRouteTables); }

}  // namespace ftjax
