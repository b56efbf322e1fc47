// Prefill gate+up grouped matmul with the input-row gather fused in (Hopper, sm_90a): the prefill's kernel 1
// (ftjax/pallas/prefill_gemm.py) reading its row tiles straight from x [T, H] through each input row's token,
// instead of from the gathered copy x_rows. At 8K tokens (Qwen3.6 shape) that copy is ~0.27 GB written by
// XLA's take (117 us) and read back by the Mosaic gate+up kernel, whose DRAM reads (1.67 GB) bound it (Nsight
// Compute, session 16); here x (33 MB at 8K) is read through L2.
//
// Why CUDA and not Mosaic GPU: Hopper's TMA has no row gather, and one TMA box per row and 64-column slice ran
// 3.88x slower (session 11: the TMA unit's rate for 128-byte boxes). Here the rows come by cp.async (16 bytes
// per thread, written into the 128-byte-swizzled layout that WGMMA reads); the weights by TMA.
//
// Layout: a persistent grid (one CTA per SM) walks the work items (row tile m, output block n) over the
// device count n_launch[0] of row tiles, n fastest (or through a walk table, routing.tile_walk). A CTA is
// three warpgroups: a producer (per stage, every thread issues cp.async for its part of the A tile [128 rows,
// 64] gathered from x, and thread 0 two TMA boxes: the weight tile [256 rows, 64] = 128 gate rows and the 128
// up rows of the same act columns) and two consumers, each 64 of the tile's rows against all 256 weight rows
// (one m64n256k16 WGMMA per 16 columns of the reduction: gate in accumulator columns 0..127, up in 128..255;
// one WGMMA group left in flight). 3- or 4-stage ring; a full barrier takes the producer threads' cp.async
// completions (cp.async.mbarrier.arrive.noinc) and the TMA's bytes, an empty barrier one arrival per consumer
// warp. The epilogue applies SwiGLU in registers and stores bf16 act rows. A consumer whose 64 rows hold no
// route (tile_rows) skips its WGMMAs and its stores (half of a group's last tile, often), but keeps the
// barrier protocol. Measured on the H200 (session 23, bench/RESULTS.md): ~9% slower than the Mosaic kernel
// on the gathered rows, but the prefill call without the row copy 3-9% faster back to back (Qwen3.6 shape).
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes through the runtime's entry point)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

constexpr int kTileM = 128;   // rows per row tile (the route tables' tile)
constexpr int kBlockN = 128;  // act columns per work item: 128 gate + 128 up weight rows
constexpr int kTileK = 64;    // reduction columns per stage: one 128-byte swizzle row
constexpr int kMaxStages = 4;  // the ring's depth is a template argument: 3 or 4 stages
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kABytes = kTileM * kTileK * 2;        // 16 KiB
constexpr int kWBytes = 2 * kBlockN * kTileK * 2;   // 32 KiB
constexpr int kStageBytes = kABytes + kWBytes;      // 48 KiB
constexpr int kEpilogueBytes = 64 * kBlockN * 2;  // a consumer's [64, 128] bf16 act tile (the SMEM epilogue)
// the ring (+ the two consumers' epilogue tiles), + slack: the swizzle atoms sit on 1 KiB
constexpr int smem_bytes(int stages, bool smem_epilogue) {
  return stages * kStageBytes + (smem_epilogue ? 2 * kEpilogueBytes : 0) + 1024;
}

struct GateUpArgs {
  const __nv_bfloat16* x;          // [T, H]
  const int32_t* token_of_input_row;  // [in_rows]
  const int32_t* tile_slot;        // [M]
  const int32_t* tile_row0;        // [M]
  const int32_t* tile_rows;        // [M]
  const int32_t* n_launch;         // [1]
  const int32_t* walk;             // [M * n_blocks] or nullptr
  __nv_bfloat16* act;              // [M * 128, I]
  int32_t tokens, hidden, inter, slots, in_rows, row_tiles, n_blocks;
  float x_keep;  // fraction of the x-row reads marked L2 evict_last (0: no hint)
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FTJAX_SM90A_DEVICE 1
#endif

#ifdef FTJAX_SM90A_DEVICE
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Waits until the barrier's phase of this parity has completed (a fresh barrier: parity 1 passes at once).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// One TMA box [rows, 64 columns] of the 2D weight view at (column c, row r) into SMEM, counted on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int32_t c, int32_t r,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c), "r"(r), "r"(bar)
      : "memory");
}

__device__ __forceinline__ uint64_t l2_evict_last_policy(float fraction) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.L2::evict_unchanged.b64 %0, %1;" : "=l"(policy) : "f"(fraction));
  return policy;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async16_hint(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(policy)
               : "memory");
}

// One arrival on `bar` once every cp.async this thread issued so far has landed (counted in the init count).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// K-major operand tile in the 128-byte swizzle (rows of 128 bytes, 8-row atoms of 1 KiB): the WGMMA matrix
// descriptor (start address / 16, leading offset unused for this layout, stride 1 KiB between 8-row groups).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return (static_cast<uint64_t>((addr & 0x3FFFF) >> 4)) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Barrier `id` (1, 2: one per consumer warpgroup; 0 is __syncthreads) over that warpgroup's 128 threads.
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Keeps the compiler from moving the accumulators while a WGMMA that writes them is in flight.
__device__ __forceinline__ void fence_operands(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// cp.async writes go through the generic proxy, WGMMA reads through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d[0..127] (+)= A[64 x 16] . B[256 x 16]^T, both K-major 128-byte-swizzled SMEM tiles given by their
// descriptors; scale_d 0 overwrites d (the first k-step of a tile), 1 accumulates. The register map of d
// (per thread of the warpgroup, warp w, lane l): d[4j + 2h + c] is row 16w + l/4 + 8h, column 8j + 2(l%4) + c.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 "
      "}, %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
__device__ __forceinline__ void item_tile(const GateUpArgs& a, int32_t item, int32_t& mi, int32_t& ni) {
  const int32_t code = a.walk != nullptr ? a.walk[item] : item;
  mi = min(max(code / a.n_blocks, 0), a.row_tiles - 1);
  ni = code % a.n_blocks;
}

// silu(g) * u. kTanh: g * sigmoid(g) as 0.5 g (1 + tanh(g / 2)), one MUFU op (tanh.approx.f32, absolute
// error ~5e-4 in the sigmoid) instead of two (ex2, rcp): the epilogue's 128 SwiGLUs per thread are MUFU-bound.
template <bool kTanh>
__device__ __forceinline__ float swiglu(float g, float u) {
  if constexpr (kTanh) {
    float th;
    const float h = 0.5f * g;
    asm("tanh.approx.f32 %0, %1;" : "=f"(th) : "f"(h));
    return fmaf(h, th, h) * u;
  } else {
    return __fdividef(g, 1.0f + __expf(-g)) * u;
  }
}
#endif  // FTJAX_SM90A_DEVICE

template <int kStages, bool kSmemEpilogue, bool kTanh>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_gate_up_gather_kernel(const GateUpArgs a, const __grid_constant__ CUtensorMap w_map) {
#ifdef FTJAX_SM90A_DEVICE
  constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // 128 x 56 + 256 x 224 <= 64 Ki registers
  __shared__ __align__(8) uint64_t full_bar[kStages], empty_bar[kStages];
  extern __shared__ uint8_t dyn_smem[];
  const uint32_t ring = (smem_addr(dyn_smem) + 1023u) & ~1023u;  // swizzle atoms sit on 1 KiB
  uint8_t* epilogue = dyn_smem + (ring - smem_addr(dyn_smem)) + kStages * kStageBytes;  // kSmemEpilogue: 2 tiles
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 129);  // every producer thread's cp.async, + thread 0's TMA bytes
      mbar_init(smem_addr(&empty_bar[s]), 8);   // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int32_t n_items = min(max(a.n_launch[0], 0), a.row_tiles) * a.n_blocks;
  const int32_t k_steps = a.hidden / kTileK;
  int stage = 0;
  uint32_t phase = 0;
  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    const int chunk = t & 7, rbase = t >> 3;  // 8 threads per 128-byte row: row rbase + 16 i, chunk `chunk`
    const uint32_t sw = static_cast<uint32_t>((chunk ^ (rbase & 7)) << 4);
    const size_t h = static_cast<size_t>(a.hidden);
    const bool keep = a.x_keep > 0.0f;
    const uint64_t policy = l2_evict_last_policy(keep ? fminf(a.x_keep, 1.0f) : 1.0f);
    for (int32_t item = blockIdx.x; item < n_items; item += gridDim.x) {
      int32_t mi, ni;
      item_tile(a, item, mi, ni);
      const int32_t slot = min(max(a.tile_slot[mi], 0), a.slots - 1), row0 = a.tile_row0[mi];
      const __nv_bfloat16* rows[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int32_t r = min(max(row0 + rbase + 16 * i, 0), a.in_rows - 1);
        const int32_t tok = min(max(a.token_of_input_row[r], 0), a.tokens - 1);
        rows[i] = a.x + static_cast<size_t>(tok) * h + chunk * 8;
      }
      const int32_t gate_row = slot * 2 * a.inter + ni * kBlockN, up_row = gate_row + a.inter;
      for (int32_t k = 0; k < k_steps; ++k) {
        const uint32_t full = smem_addr(&full_bar[stage]);
        mbar_wait(smem_addr(&empty_bar[stage]), phase ^ 1);
        const uint32_t base = ring + stage * kStageBytes;
        if (t == 0) {  // the weight tile: 128 gate rows, then the 128 up rows of the same act columns
          mbar_arrive_expect_tx(full, kWBytes);
          tma_load_2d(base + kABytes, &w_map, k * kTileK, gate_row, full);
          tma_load_2d(base + kABytes + kWBytes / 2, &w_map, k * kTileK, up_row, full);
        }
        const uint32_t sa = base + rbase * 128 + sw;
        const size_t col = static_cast<size_t>(k) * kTileK;
        if (keep) {
#pragma unroll
          for (int i = 0; i < 8; ++i) cp_async16_hint(sa + i * 16 * 128, rows[i] + col, policy);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) cp_async16(sa + i * 16 * 128, rows[i] + col);
        }
        cp_async_arrive(full);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {  // consumers: rows 64 * cw .. of each tile
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    const int cw = wg - 1, warp = t / 32, lane = t % 32;
    const auto release = [&](int st) {  // one arrival per consumer warp on the stage's empty barrier
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty_bar[st]));
    };
    float acc[128];
    for (int32_t item = blockIdx.x; item < n_items; item += gridDim.x) {
      int32_t mi, ni;
      item_tile(a, item, mi, ni);
      const bool live = a.tile_rows[mi] > cw * 64;
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      if (live) {  // the whole k-loop per branch: no WGMMA group in flight across a divergent branch
        for (int32_t k = 0; k < k_steps; ++k) {
          mbar_wait(smem_addr(&full_bar[stage]), phase);
          fence_proxy_async();
          fence_operands(acc);
          wgmma_fence();
          const uint64_t da = sw128_desc(ring + stage * kStageBytes + cw * 64 * 128);
          const uint64_t db = sw128_desc(ring + stage * kStageBytes + kABytes);
#pragma unroll
          for (int kk = 0; kk < kTileK / 16; ++kk) wgmma_m64n256k16(acc, da + 2 * kk, db + 2 * kk, 1);
          wgmma_commit();
          wgmma_wait<1>();  // the previous step's group is done: its stage can go back
          fence_operands(acc);
          if (k > 0) release(stage == 0 ? kStages - 1 : stage - 1);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
        wgmma_wait<0>();
        fence_operands(acc);
        release(stage == 0 ? kStages - 1 : stage - 1);
      } else {  // rows without routes: keep the barrier protocol, compute nothing
        for (int32_t k = 0; k < k_steps; ++k) {
          mbar_wait(smem_addr(&full_bar[stage]), phase);
          release(stage);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }
      if (live && !kSmemEpilogue) {  // each thread's act pairs straight to global (16-byte runs per 4 lanes)
        const int32_t row = mi * kTileM + cw * 64 + warp * 16 + lane / 4;
        __nv_bfloat16* out = a.act + static_cast<size_t>(row) * a.inter + ni * kBlockN + 2 * (lane % 4);
        const size_t down8 = static_cast<size_t>(8) * a.inter;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float* g = acc + 4 * j;
          const float* u = acc + 64 + 4 * j;
          *reinterpret_cast<__nv_bfloat162*>(out + 8 * j) =
              __floats2bfloat162_rn(swiglu<kTanh>(g[0], u[0]), swiglu<kTanh>(g[1], u[1]));
          *reinterpret_cast<__nv_bfloat162*>(out + down8 + 8 * j) =
              __floats2bfloat162_rn(swiglu<kTanh>(g[2], u[2]), swiglu<kTanh>(g[3], u[3]));
        }
      }
      if (live && kSmemEpilogue) {  // through this warpgroup's [64, 128] bf16 SMEM tile, then whole-row stores
        // 16-byte chunk j of row r sits at chunk j ^ (r % 8): the writes (8 rows x 4 words per warp) and the
        // reads (2 rows x 16 chunks per warp) both spread over every bank
        uint8_t* tile = epilogue + cw * kEpilogueBytes;
        named_barrier_sync(1 + cw);  // this warpgroup's reads of the previous tile are done
        const int r0 = warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float* g = acc + 4 * j;
          const float* u = acc + 64 + 4 * j;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            *reinterpret_cast<__nv_bfloat162*>(tile + r * 256 + ((j ^ (r & 7)) << 4) + (lane % 4) * 4) =
                __floats2bfloat162_rn(swiglu<kTanh>(g[2 * h], u[2 * h]), swiglu<kTanh>(g[2 * h + 1], u[2 * h + 1]));
          }
        }
        named_barrier_sync(1 + cw);  // the tile is written
        const int c = t % 16;
        __nv_bfloat16* out = a.act + static_cast<size_t>(mi * kTileM + cw * 64) * a.inter + ni * kBlockN + c * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = t / 16 + 8 * i;
          *reinterpret_cast<uint4*>(out + static_cast<size_t>(r) * a.inter) =
              *reinterpret_cast<const uint4*>(tile + r * 256 + ((c ^ (r & 7)) << 4));
        }
      }
    }
  }
#endif  // FTJAX_SM90A_DEVICE
}

std::string tag(const std::string& what) { return "prefill_gate_up: " + what; }

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder through the runtime (the module does not link libcuda); null if absent.
EncodeTiledFn tensor_map_encoder() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
    return e == cudaSuccess && q == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiledFn>(p) : nullptr;
  }();
  return fn;
}

// The weights as a 2D [S * 2I rows, H] bf16 view, boxes of 128 rows x 64 columns in the 128-byte swizzle.
bool weight_map(CUtensorMap* map, const void* w, int64_t rows, int64_t hidden, CUtensorMapL2promotion promotion,
                std::string* why) {
  const EncodeTiledFn encode = tensor_map_encoder();
  if (encode == nullptr) {
    *why = "the driver has no cuTensorMapEncodeTiled";
    return false;
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(hidden), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(hidden) * 2};
  const cuuint32_t box[2] = {kTileK, kBlockN}, elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(w), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    *why = "cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(r)) + ")";
    return false;
  }
  return true;
}

// The kernel is sm_90a code only (WGMMA, setmaxnreg): other devices get an error, never a launch.
bool device_is_sm90(std::string* name) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return false;
  *name = std::to_string(major) + "." + std::to_string(minor);
  return major == 9 && minor == 0;
}

ffi::Error PrefillGateUpImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> token_of_input_row,
                             ffi::Buffer<ffi::S32> tile_slot, ffi::Buffer<ffi::S32> tile_row0,
                             ffi::Buffer<ffi::S32> tile_rows, ffi::Buffer<ffi::S32> n_launch,
                             ffi::Buffer<ffi::S32> walk, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> act,
                             int64_t n_blocks, int64_t use_walk, int64_t grid, float x_keep, int64_t stages,
                             int64_t w_promotion, int64_t epilogue_smem, int64_t silu_tanh) {
  std::string cc = "unknown";
  if (!device_is_sm90(&cc))
    return ffi::Error::InvalidArgument(tag("needs an sm_90 GPU (H100 / H200), this one is " + cc));
  if (x.element_type() != ffi::BF16 || w.element_type() != ffi::BF16 || act->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument(tag("x, the weights and act must be bf16"));
  const auto xd = x.dimensions(), wd = w.dimensions(), ad = act->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || ad.size() != 2)
    return ffi::Error::InvalidArgument(tag("want x [T, H], weights [S, 2I, H], act [rows, I]"));
  const int64_t T = xd[0], H = xd[1], S = wd[0], I = ad[1];
  const int64_t M = static_cast<int64_t>(tile_slot.element_count());
  if (T < 1 || H < kTileK || H % kTileK != 0 || I < kBlockN || I % kBlockN != 0 || wd[1] != 2 * I || wd[2] != H ||
      S < 1)
    return ffi::Error::InvalidArgument(
        tag("x [" + std::to_string(T) + ", " + std::to_string(H) + "], weights [" + std::to_string(S) + ", " +
            std::to_string(wd[1]) + ", " + std::to_string(wd[2]) + "], act columns " + std::to_string(I) +
            ": need H a multiple of 64, I of 128, weights [S, 2I, H]"));
  if (M < 1 || ad[0] != M * kTileM || static_cast<int64_t>(tile_row0.element_count()) != M ||
      static_cast<int64_t>(tile_rows.element_count()) != M || n_launch.element_count() != 1 ||
      token_of_input_row.element_count() < 1 || n_blocks != I / kBlockN)
    return ffi::Error::InvalidArgument(tag("row-tile tables, act rows (" + std::to_string(ad[0]) +
                                           ") and output blocks do not match 128-row tiles"));
  if (use_walk && static_cast<int64_t>(walk.element_count()) != M * n_blocks)
    return ffi::Error::InvalidArgument(tag("the walk table must hold row tiles x output blocks entries"));
  if (T * H >= (int64_t{1} << 40) || M * kTileM >= (int64_t{1} << 30) || S * 2 * I >= (int64_t{1} << 31) ||
      grid < 1 || grid > 4096 || !(x_keep >= 0.0f && x_keep <= 1.0f) || (stages != 3 && stages != kMaxStages))
    return ffi::Error::InvalidArgument(tag("sizes out of range (grid " + std::to_string(grid) + ", x_keep " +
                                           std::to_string(x_keep) + ", stages " + std::to_string(stages) + ")"));
  CUtensorMap w_map;
  std::string why;
  // the weights' L2 fetch size per TMA row (0: none, 1: 64 B, 2: 128 B, 3: 256 B: CUtensorMapL2promotion)
  if (w_promotion < 0 || w_promotion > 3)
    return ffi::Error::InvalidArgument(tag("w_promotion must be 0..3, got " + std::to_string(w_promotion)));
  if (!weight_map(&w_map, w.untyped_data(), S * 2 * I, H, static_cast<CUtensorMapL2promotion>(w_promotion), &why))
    return ffi::Error::Internal(tag(why));
  GateUpArgs a{};
  a.x = static_cast<const __nv_bfloat16*>(x.untyped_data());
  a.token_of_input_row = token_of_input_row.typed_data();
  a.tile_slot = tile_slot.typed_data();
  a.tile_row0 = tile_row0.typed_data();
  a.tile_rows = tile_rows.typed_data();
  a.n_launch = n_launch.typed_data();
  a.walk = use_walk ? walk.typed_data() : nullptr;
  a.act = static_cast<__nv_bfloat16*>(act->untyped_data());
  a.tokens = static_cast<int32_t>(T);
  a.hidden = static_cast<int32_t>(H);
  a.inter = static_cast<int32_t>(I);
  a.slots = static_cast<int32_t>(S);
  a.in_rows = static_cast<int32_t>(token_of_input_row.element_count());
  a.row_tiles = static_cast<int32_t>(M);
  a.n_blocks = static_cast<int32_t>(n_blocks);
  a.x_keep = x_keep;
  const auto launch = [&](auto kernel, int bytes) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess) {
      kernel<<<static_cast<unsigned>(grid), kThreads, bytes, stream>>>(a, w_map);
      e = cudaGetLastError();
    }
    return e;
  };
  // one instantiation per (stages, SMEM epilogue, tanh SwiGLU)
  const auto pick = [&](auto tanh_tag) {
    constexpr bool kT = decltype(tanh_tag)::value;
    if (epilogue_smem)
      return stages == 3 ? launch(prefill_gate_up_gather_kernel<3, true, kT>, smem_bytes(3, true))
                         : launch(prefill_gate_up_gather_kernel<4, true, kT>, smem_bytes(4, true));
    return stages == 3 ? launch(prefill_gate_up_gather_kernel<3, false, kT>, smem_bytes(3, false))
                       : launch(prefill_gate_up_gather_kernel<4, false, kT>, smem_bytes(4, false));
  };
  const cudaError_t err = silu_tanh ? pick(std::true_type{}) : pick(std::false_type{});
  if (err != cudaSuccess) return ffi::Error::Internal(tag(std::string("launch: ") + cudaGetErrorString(err)));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxPrefillGateUp, PrefillGateUpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("n_blocks")
                                  .Attr<int64_t>("use_walk")
                                  .Attr<int64_t>("grid")
                                  .Attr<float>("x_keep")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("w_promotion")
                                  .Attr<int64_t>("epilogue_smem")
                                  .Attr<int64_t>("silu_tanh"),
                              {ffi::Traits::kCmdBufferCompatible});

void* prefill_gate_up_handler() { return reinterpret_cast<void*>(FtjaxPrefillGateUp); }

}  // namespace ftjax
