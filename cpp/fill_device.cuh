// The expert copy shared by the fill kernels (ffi_cuda.cu, background.cu): device code, nvcc only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "pool.h"

namespace ftjax {

constexpr int kFillThreads = 256;
constexpr int kFillUnroll = 4;  // 16-byte loads in flight per thread: hides PCIe read latency

// Transfer priority (OffloadExperts.background_yield): two device words, process-wide
// (`transfer_words`): [0] thread blocks of in-step fills running, [1] CPU branches in flight (submitted,
// not yet collected). The step's background fill may pause while they are nonzero, so the transfers
// a decode call waits for get the PCIe link (and the host's DRAM) to themselves.
enum TransferWord : int { kWordFills = 0, kWordCpu = 1 };
enum YieldMask : int32_t { kYieldFills = 1, kYieldCpu = 2 };
constexpr uint64_t kYieldMaxWaitNs = 200000;    // one pause at most 200 us...
constexpr uint64_t kYieldMaxTotalNs = 2000000;  // ... and 2 ms in all per thread and launch (a stuck word only slows)

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The background fill's gate: its copy loops call wait() before an iteration's loads and sample() after
// them, so the words' loads of one iteration are read at the next and their latency hides behind the
// copy's own PCIe reads.
struct YieldGate {
  const int32_t* words;  // nullptr or mask 0: never pauses
  int32_t mask;
  int32_t busy = 0;
  uint64_t paused = 0;
  __device__ int32_t busy_now() const {
    const volatile int32_t* w = words;
    return ((mask & kYieldFills) && w[kWordFills] > 0) || ((mask & kYieldCpu) && w[kWordCpu] > 0);
  }
  __device__ void sample() { busy = (words && mask && paused < kYieldMaxTotalNs) ? busy_now() : 0; }
  __device__ void wait() {
    if (!busy) return;
    const uint64_t t0 = global_ns();
    uint64_t now = t0;
    while (busy_now() && now - t0 < kYieldMaxWaitNs && paused + (now - t0) < kYieldMaxTotalNs) {
      __nanosleep(1000);
      now = global_ns();
    }
    paused += now - t0;
    busy = 0;
  }
};

// An in-step fill's thread block counts itself in word 0 while it copies (`words` nullptr: not counted).
// Call both from every thread of the block (enter before the copy, leave after it).
__device__ __forceinline__ void fill_block_enter(int32_t* words) {
  if (words && threadIdx.x == 0) atomicAdd(words + kWordFills, 1);
}
__device__ __forceinline__ void fill_block_leave(int32_t* words) {
  if (!words) return;
  __syncthreads();
  if (threadIdx.x == 0) atomicSub(words + kWordFills, 1);
}

// A pool whose down bank is stored transposed (DownLayout::kIH, host [I, H] per expert): the fills write the
// slot's [H, I] (`on`), `per16` elements (8 bf16, 4 f32) per 16 bytes; hidden and inter multiples of 8.
struct DownT {
  bool on = false;
  int64_t hidden = 0, inter = 0, per16 = 0;
};

// The fills' view of a pool's down layout (host code); throws where a transposed down cannot be copied.
inline DownT down_t_of(const ExpertPool& pool) {
  if (!pool.down_transposed()) return DownT{};
  if (pool.hidden() % 8 || pool.inter() % 8)
    throw std::invalid_argument("a transposed down (down_layout 'ih') is filled in tiles of 8 x 8: hidden and inter "
                                "must be multiples of 8, got " + std::to_string(pool.hidden()) + ", " +
                                std::to_string(pool.inter()));
  return DownT{true, pool.hidden(), pool.inter(), pool.down().format == WeightFormat::kBF16 ? int64_t{8} : int64_t{4}};
}

// Rows [i0, i1) (multiples of 8) of expert `id`'s transposed down ([I, H] on the host) into columns [i0, i1) of
// slot `slot`'s [H, I]. An item is 8 host rows x 16 bytes of columns: adjacent threads read adjacent 16 bytes of a row
// (a warp reads 512 contiguous bytes of each of its 8 rows: the PCIe reads stay as long as copy_expert's), transpose
// in registers and write 16 (bf16) or 32 (f32) bytes into each of 8 (bf16) or 4 (f32) slot rows.
__device__ __forceinline__ void copy_down_t(int64_t id, int64_t slot, int64_t i0, int64_t i1, int64_t worker,
                                            int64_t workers, const DownT& dt, const uint4* __restrict__ src1,
                                            uint4* __restrict__ dst1, int64_t row1, YieldGate* gate) {
  const int64_t chunks = dt.hidden / dt.per16, n_items = (i1 - i0) / 8 * chunks;  // 16-byte chunks of a host row
  const uint4* src = src1 + id * row1;
  uint4* dst = dst1 + slot * row1;
  const int64_t src_row = chunks, dst_row = dt.inter / dt.per16;  // row strides in 16-byte units
  for (int64_t q = worker; q < n_items; q += workers) {
    if (gate) gate->wait();
    const int64_t ig = i0 / 8 + q / chunks, c = q - (q / chunks) * chunks;
    uint4 v[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) v[r] = src[(8 * ig + r) * src_row + c];
    if (gate) gate->sample();
    const auto word = [&](int r, int m) -> uint32_t {
      return m == 0 ? v[r].x : m == 1 ? v[r].y : m == 2 ? v[r].z : v[r].w;
    };
    if (dt.per16 == 8) {  // bf16: slot row h = 8c + k gets the 8 host rows' element k, pairs of rows per word
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const unsigned sel = (k & 1) ? 0x7632u : 0x5410u;
        uint4 o;
        o.x = __byte_perm(word(0, k / 2), word(1, k / 2), sel);
        o.y = __byte_perm(word(2, k / 2), word(3, k / 2), sel);
        o.z = __byte_perm(word(4, k / 2), word(5, k / 2), sel);
        o.w = __byte_perm(word(6, k / 2), word(7, k / 2), sel);
        dst[(8 * c + k) * dst_row + ig] = o;
      }
    } else {  // f32: slot row h = 4c + k gets the 8 host rows' element k, 32 bytes
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        dst[(4 * c + k) * dst_row + 2 * ig] = make_uint4(word(0, k), word(1, k), word(2, k), word(3, k));
        dst[(4 * c + k) * dst_row + 2 * ig + 1] = make_uint4(word(4, k), word(5, k), word(6, k), word(7, k));
      }
    }
  }
}

// Copies expert `id` of the pool into cache slot `slot`, both banks, the rows split over `workers`
// threads of which this is `worker` (a transposed down, `dt.on`: by copy_down_t after gate/up).
__device__ __forceinline__ void copy_expert(int64_t id, int64_t slot, int64_t worker, int64_t workers,
                                            const uint4* __restrict__ src0, uint4* __restrict__ dst0, int64_t row0,
                                            const uint4* __restrict__ src1, uint4* __restrict__ dst1, int64_t row1,
                                            YieldGate* gate = nullptr, const DownT& dt = DownT{}) {
  if (dt.on) copy_down_t(id, slot, 0, dt.inter, worker, workers, dt, src1, dst1, row1, gate);
  const int64_t total = row0 + (dt.on ? 0 : row1);  // the two banks' rows, in 16-byte units, back to back
  for (int64_t base = worker; base < total; base += kFillUnroll * workers) {
    if (gate) gate->wait();
    uint4 v[kFillUnroll];
#pragma unroll
    for (int u = 0; u < kFillUnroll; ++u) {
      const int64_t i = base + u * workers;
      if (i < total) v[u] = i < row0 ? src0[id * row0 + i] : src1[id * row1 + (i - row0)];
    }
    if (gate) gate->sample();
#pragma unroll
    for (int u = 0; u < kFillUnroll; ++u) {
      const int64_t i = base + u * workers;
      if (i < total) {
        if (i < row0) dst0[slot * row0 + i] = v[u];
        else dst1[slot * row1 + (i - row0)] = v[u];
      }
    }
  }
}

// Units [u0, u1) of expert `id` into slot `slot` (the unit split; bf16/f32 banks, `per16` elements per
// 16 bytes, u0 and u1 multiples of 8): gate rows [u0, u1) and up rows [I + u0, I + u1) of gate_up
// ([2I, H] per expert: one range each) and columns [u0, u1) of every row of down ([H, I]; from a transposed
// down's rows [u0, u1), `dt.on`); nothing else of the slot.
__device__ __forceinline__ void copy_units(int64_t id, int64_t slot, int64_t u0, int64_t u1, int64_t worker,
                                           int64_t workers, int64_t hidden, int64_t inter, int64_t per16,
                                           const uint4* __restrict__ src0, uint4* __restrict__ dst0, int64_t row0,
                                           const uint4* __restrict__ src1, uint4* __restrict__ dst1, int64_t row1,
                                           YieldGate* gate = nullptr, const DownT& dt = DownT{}) {
  if (u1 <= u0) return;
  if (dt.on) copy_down_t(id, slot, u0, u1, worker, workers, dt, src1, dst1, row1, gate);
  const int64_t g16 = (u1 - u0) * hidden / per16, gate0 = u0 * hidden / per16, up0 = (inter + u0) * hidden / per16;
  const int64_t c16 = (u1 - u0) / per16, col0 = u0 / per16, row16 = inter / per16;
  const int64_t total = 2 * g16 + (dt.on ? 0 : hidden * c16);
  for (int64_t base = worker; base < total; base += kFillUnroll * workers) {
    if (gate) gate->wait();
    uint4 v[kFillUnroll];
    bool dn[kFillUnroll];
    int64_t off[kFillUnroll];
#pragma unroll
    for (int k = 0; k < kFillUnroll; ++k) {
      const int64_t i = base + k * workers;
      if (i < total) {
        if (i < g16) {
          dn[k] = false, off[k] = gate0 + i;
        } else if (i < 2 * g16) {
          dn[k] = false, off[k] = up0 + (i - g16);
        } else {
          const int64_t j = i - 2 * g16, h = j / c16;
          dn[k] = true, off[k] = h * row16 + col0 + (j - h * c16);
        }
        v[k] = dn[k] ? src1[id * row1 + off[k]] : src0[id * row0 + off[k]];
      }
    }
    if (gate) gate->sample();
#pragma unroll
    for (int k = 0; k < kFillUnroll; ++k) {
      if (base + k * workers < total) {
        if (dn[k]) dst1[slot * row1 + off[k]] = v[k];
        else dst0[slot * row0 + off[k]] = v[k];
      }
    }
  }
}

}  // namespace ftjax
