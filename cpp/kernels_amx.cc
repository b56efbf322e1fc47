// AMX tier (AMX-TILE + AMX-BF16): bf16 or int4 weights times bf16 activations on the tile unit
// with TDPBF16PS (bf16 pair products summed in fp32, like VDPBF16PS); int4 rows are dequantized to
// bf16 (q - 8) * scale (rounded once) into an L1 buffer a chunk ahead of the tile loads, so the
// tile unit does the multiply-adds of every token of the call at once. Every other case - f32
// weights, f32 activations, K < 32, the rows past the last full block of 16 - goes to the
// AVX-512-BF16 tier unchanged.
// It computes C^T = W . X^T, 16 weight rows x up to 16 tokens per C tile: the A tiles (16 rows x
// 32 k) load straight from the bank with row stride K * 2 bytes, so only the few activation
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

// NB blocks of 16 weight rows from w (row stride K) times the B tiles at b (row stride n pairs):
// out[i * n + j] for i < 16 * NB, j < nb. Each B tile is loaded once for the NB blocks.
// Each k-step also prefetches every row's line `pf` bytes ahead (prefetch_bytes(); 0 = off).
template <int NB>
void row_blocks(const uint16_t* w, int64_t K, const uint32_t* b, int n, int nb, float* out, int64_t pf) {
  alignas(64) uint16_t tail[16 * NB][32];
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  for (int64_t k = 0; k < K; k += 32) {
    if (pf > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + k) + pf;
      for (int i = 0; i < 16 * NB; ++i) _mm_prefetch(ahead + i * K * 2, _MM_HINT_T0);
    }
    const uint16_t* a0 = w + k;
    int64_t stride = K;  // elements
    if (k + 32 > K) {    // last partial step: a zero-padded copy of the weight columns [k, K);
                         // B is zero there too, and both pads are zero so no NaN x 0 leaks in
      std::memset(tail, 0, sizeof tail);
      for (int i = 0; i < 16 * NB; ++i) std::memcpy(tail[i], w + i * K + k, (K - k) * 2);
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

// One int4 weight row's group of 32 (16 bytes of nibbles, element 2b in the low nibble of byte b)
// times its bf16 scale, as 32 bf16 of (q - 8) * scale (the fp32 product rounded to bf16 once, as
// the GPU int4 kernels do), stored at dst (64 bytes).
inline void dequant_group(const uint8_t* q, uint16_t scale, uint16_t* dst) {
  alignas(64) static constexpr float kMinus8[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, nib), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
  const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
  const __m512 vals = _mm512_mul_ps(_mm512_set1_ps(bf16_to_f32(scale)), _mm512_load_ps(kMinus8));
  const __m512i lut = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(vals)));
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, lut));
}

// int4 rows: NB blocks of 16 rows from q (packed, row stride K / 2 bytes) and s (bf16 scales, row
// stride K / 32), K % 32 == 0. The rows are dequantized kChunk columns at a time into an L1 double
// buffer, one chunk ahead of the tile unit: chunk c + 1 is written while the tiles read chunk c, so
// a tile load never reads stores still in flight (the first version, which dequantized each group
// just before its tile load, ran at 0.13-0.25 of STREAM on the H200 host, session 11).
template <int NB>
void row_blocks_int4(const uint8_t* q, const uint16_t* s, int64_t K, const uint32_t* b, int n, int nb, float* out,
                     int64_t pf) {
  constexpr int64_t kChunk = 256;  // 16 * NB rows x 256 bf16: 8 / 16 KiB per buffer
  alignas(64) uint16_t deq[2][16 * NB][kChunk];
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  const auto dequant = [&](int64_t c) {
    const int64_t k0 = c * kChunk, kc = std::min(kChunk, K - k0);
    for (int i = 0; i < 16 * NB; ++i) {
      const uint8_t* qi = q + i * (K / 2) + k0 / 2;
      const uint16_t* si = s + i * (K / 32) + k0 / 32;
      if (pf > 0) {  // the row's kChunk / 2 = 128 bytes of this chunk, pf bytes ahead
        _mm_prefetch(reinterpret_cast<const char*>(qi) + pf, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(qi) + pf + 64, _MM_HINT_T0);
      }
      for (int64_t g = 0; g < kc / 32; ++g) dequant_group(qi + g * 16, si[g], &deq[c & 1][i][g * 32]);
    }
  };
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  dequant(0);
  for (int64_t c = 0; c < chunks; ++c) {
    publish(deq);  // the tile loads of chunk c - 1 stay before the stores into their buffer
    if (c + 1 < chunks) dequant(c + 1);
    publish(deq);
    const int64_t k0 = c * kChunk, kc = std::min(kChunk, K - k0);
    for (int64_t kk = 0; kk < kc; kk += 32) {
      _tile_loadd(4, b + (k0 + kk) / 2 * n, 4 * n);
      _tile_loadd(2, &deq[c & 1][0][kk], 2 * kChunk);
      _tile_dpbf16ps(0, 2, 4);
      if constexpr (NB == 2) {
        _tile_loadd(3, &deq[c & 1][16][kk], 2 * kChunk);
        _tile_dpbf16ps(1, 3, 4);
      }
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
  const bool int4 = w.format == WeightFormat::kInt4 && K % 32 == 0;
  if ((w.format != WeightFormat::kBF16 && !int4) || a.bf16 == nullptr || K < 32 || r_amx == r0)
    return dot_rows_avx512bf16(w, r0, r1, a, out);
  const uint32_t* b = repack(a, K);
  const int64_t pf = prefetch_bytes();
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(w.data);
  for (int j0 = 0; j0 < a.n; j0 += 16) {
    const int nb = std::min(16, a.n - j0);
    configure(nb);
    int64_t r = r0;
    float* o = out + j0;
    if (int4) {
      const auto q = [&](int64_t row) { return w.data + row * (K / 2); };
      const auto sc = [&](int64_t row) { return w.scales + row * (K / 32); };
      for (; r + 32 <= r_amx; r += 32) row_blocks_int4<2>(q(r), sc(r), K, b + j0, a.n, nb, o + (r - r0) * a.n, pf);
      if (r < r_amx) row_blocks_int4<1>(q(r), sc(r), K, b + j0, a.n, nb, o + (r - r0) * a.n, pf);
      continue;
    }
    for (; r + 32 <= r_amx; r += 32) row_blocks<2>(wd + r * K, K, b + j0, a.n, nb, o + (r - r0) * a.n, pf);
    if (r < r_amx) row_blocks<1>(wd + r * K, K, b + j0, a.n, nb, o + (r - r0) * a.n, pf);
  }
  if (r_amx < r1) dot_rows_avx512bf16(w, r_amx, r1, a, out + (r_amx - r0) * a.n);
}

}  // namespace ftjax
