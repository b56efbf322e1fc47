// AMX tier (AMX-TILE + AMX-BF16): bf16 weights times bf16 activations on the tile unit with
// TDPBF16PS (bf16 pair products summed in fp32, like VDPBF16PS). Every other case - f32 or int4
// weights, f32 activations, K < 32, the rows past the last full block of 16 - goes to the
// AVX-512-BF16 tier unchanged.
// It computes C^T = W . X^T, 16 weight rows x up to 16 tokens per C tile: the A tiles (16 rows x
// 32 k) load straight from the bank with the matrix's row stride, so only the few activation
// vectors are repacked, once per call, into the VNNI pair layout that the B tile needs.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace ftjax {
namespace {
constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request permission for an XSAVE feature
constexpr int kXfeatureXtiledata = 18;

// GCC's LDTILECFG / TILELOADD intrinsics do not tell the compiler that they read the memory they
// point at (no "memory" clobber), so a buffer written just before one is published with this.
inline void publish(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

// LDTILECFG's 64-byte operand, palette 1. tmm0, tmm1: C, 16 weight rows x nb fp32; tmm2, tmm3:
// A, 16 weight rows x 32 bf16; tmm4: B, 16 k-pairs x nb tokens x 2 bf16. Unused tiles stay zero.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Loaded on every call (cheap against the 16 x K weight rows a call reads): other code on the same
// thread (oneDNN inside XLA or torch) may reconfigure or release the tiles between our calls.
void configure(int nb) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>((t == 2 || t == 3) ? 64 : 4 * nb);
  }
  publish(&cfg);
  _tile_loadconfig(&cfg);
}

// In-register 16 x 16 dword transpose, r[j] = pairs 0..15 of token j -> r[p] = pair p of tokens
// 0..15: dwords, then qwords within 128-bit lanes, then whole lanes.
void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // now r[i + c], lane L = pair 4L + c of tokens i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i lo0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), hi0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i lo1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44),
                  hi1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(lo0, lo1, 0x88);  // lane 0 of each
    t[4 + c] = _mm512_shuffle_i32x4(lo0, lo1, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(hi0, hi1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(hi0, hi1, 0xDD);
  }
  for (int p = 0; p < 16; ++p) r[p] = t[p];
}

// vnni[p * n + j] = bf16 pair (x_j[2p], x_j[2p + 1]) as one dword for p < ceil(K / 32) * 16, zero
// past K (so the last partial k-step adds exact zeros). The B tile of tokens [j0, j0 + 16) at
// k-step k is 16 rows of it from vnni + k / 2 * n + j0, row stride 4n bytes.
const uint32_t* repack(const ActRef& a, int64_t K) {
  const int n = a.n;
  thread_local std::vector<uint32_t> buf;
  const size_t need = static_cast<size_t>((K + 31) / 32) * 16 * n + 16;
  if (buf.size() < need) buf.resize(need);
  uint32_t* vnni = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  const __m512i row_of_pair = _mm512_mullo_epi32(_mm512_set1_epi32(n), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                                          9, 10, 11, 12, 13, 14, 15));
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 in_k = K - k >= 32 ? ~__mmask32{0} : (__mmask32{1} << (K - k)) - 1;
    for (int j0 = 0; j0 < n; j0 += 16) {
      const int nb = std::min(16, n - j0);
      uint32_t* dst = vnni + k / 2 * n + j0;
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j < nb ? _mm512_maskz_loadu_epi16(in_k, a.bf16 + (j0 + j) * a.stride + k) : _mm512_setzero_si512();
      if (nb < 8) {  // the transpose costs the same for any nb; fewer scatters cost less (by count, untimed)
        for (int j = 0; j < nb; ++j) _mm512_i32scatter_epi32(dst + j, row_of_pair, r[j], 4);
        continue;
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_mask_storeu_epi32(dst + p * n, static_cast<__mmask16>((1u << nb) - 1), r[p]);
    }
  }
  publish(vnni);
  return vnni;
}

// NB blocks of 16 weight rows from w (K columns, row stride ld) times the B tiles at b (row stride n pairs):
// out[i * n + j] for i < 16 * NB, j < nb. Each B tile is loaded once for the NB blocks.
// Each k-step also prefetches every row's line `pf` bytes ahead (prefetch_bytes(); 0 = off).
template <int NB>
void row_blocks(const uint16_t* w, int64_t K, int64_t ld, const uint32_t* b, int n, int nb, float* out, int64_t pf) {
  alignas(64) uint16_t tail[16 * NB][32];
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  for (int64_t k = 0; k < K; k += 32) {
    if (pf > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + k) + pf;
      for (int i = 0; i < 16 * NB; ++i) _mm_prefetch(ahead + i * ld * 2, _MM_HINT_T0);
    }
    const uint16_t* a0 = w + k;
    int64_t stride = ld;  // elements
    if (k + 32 > K) {    // last partial step: a zero-padded copy of the weight columns [k, K);
                         // B is zero there too, and both pads are zero so no NaN x 0 leaks in
      std::memset(tail, 0, sizeof tail);
      for (int i = 0; i < 16 * NB; ++i) std::memcpy(tail[i], w + i * ld + k, (K - k) * 2);
      publish(tail);
      a0 = tail[0];
      stride = 32;
    }
    _tile_loadd(4, b + k / 2 * n, 4 * n);
    _tile_loadd(2, a0, 2 * stride);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (NB == 2) {
      _tile_loadd(3, a0 + 16 * stride, 2 * stride);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  alignas(64) float c[16 * NB][16];
  _tile_stored(0, c[0], 64);
  if constexpr (NB == 2) _tile_stored(1, c[16], 64);
  for (int i = 0; i < 16 * NB; ++i)
    for (int j = 0; j < nb; ++j) out[i * n + j] = c[i][j];
}
}  // namespace

bool amx_enable() {
  // Linux grants the AMX tile state per process on request; a tile instruction before that
  // raises SIGILL.
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

void dot_rows_amx(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out) {
  const int64_t K = w.cols, r_amx = r0 + (r1 - r0) / 16 * 16;  // AMX rows: [r0, r_amx)
  if (w.format != WeightFormat::kBF16 || a.bf16 == nullptr || K < 32 || r_amx == r0)
    return dot_rows_avx512bf16(w, r0, r1, a, out);
  const uint32_t* b = repack(a, K);
  const int64_t pf = prefetch_bytes();
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(w.data);
  for (int j0 = 0; j0 < a.n; j0 += 16) {
    const int nb = std::min(16, a.n - j0);
    configure(nb);
    int64_t r = r0;
    for (; r + 32 <= r_amx; r += 32)
      row_blocks<2>(wd + r * w.ld, K, w.ld, b + j0, a.n, nb, out + (r - r0) * a.n + j0, pf);
    if (r < r_amx) row_blocks<1>(wd + r * w.ld, K, w.ld, b + j0, a.n, nb, out + (r - r0) * a.n + j0, pf);
  }
  if (r_amx < r1) dot_rows_avx512bf16(w, r_amx, r1, a, out + (r_amx - r0) * a.n);
}

}  // namespace ftjax
