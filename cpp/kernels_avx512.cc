// AVX-512 tier (F + BW + VL + BF16): bf16 weights widen to f32 for f32 activations (exact
// products), or multiply pairwise with VDPBF16PS when the activations are bf16; int4 groups of 32
// are unpacked, shifted by 8 and scaled in registers. A micro-tile is R weight rows x N
// activations: each weight vector is loaded once per tile and feeds N accumulators.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "kernels_axpy.h"
#include "kernels_tiling.h"

namespace ftjax {
namespace {

// Software prefetch of each weight row `pf` bytes ahead of the loads (0: off). A core reading 4-8
// row streams while it computes does not keep enough lines in flight from the hardware prefetcher
// alone (512 bytes: dev box int4 17.8 -> 24.5 GB/s with 2 threads; H200 host, 15 threads, Qwen-sized
// bf16 experts 98 -> 112 GB/s of a 130 GB/s STREAM read: bench/RESULTS.md, session 5).
// `p` (row_prefetch): the distance, and where it stops or moves into the next tile's rows.
template <int R, class T>
inline void prefetch_rows(const T* const (&row)[R], int64_t elem, const RowPrefetch& p) {
  const int64_t ahead = p.ahead(static_cast<int64_t>(sizeof(T)) * elem);
  if (ahead == RowPrefetch::kNone) return;
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(row[i] + elem) + ahead, _MM_HINT_T0);
}
inline int64_t bytes_of(const MatrixRef& w, int64_t elems) {
  return w.format == WeightFormat::kInt4 ? elems / 2 : elems * (w.format == WeightFormat::kF32 ? 4 : 2);
}
inline int64_t row_bytes_of(const MatrixRef& w) { return bytes_of(w, w.ld); }  // the row stride in bytes
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// VPERMW indices that put scale word d / 4 of a span into the high word of dword d (the low words masked to 0).
alignas(64) constexpr uint16_t kQ15ScaleIdx[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1,
                                                   0, 2, 0, 2, 0, 2, 0, 2, 0, 3, 0, 3, 0, 3, 0, 3};

// The sums of four vectors' lanes, in order: pairs interleave and add (lanes 2m, 2m + 1 of each 128-bit lane
// hold a's and b's partial sums), then the pairs' pairs, then the four 128-bit lanes add up.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0 b0 a1 b1 per lane
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// acc[i][j] += the lanes of W[r + i, :k] . a_j (j < N, vectors j0 ..), returns k: the first column left for a scalar
// tail (K for int4 and whole steps). r_end: the end of the call's rows (its work item): short rows prefetch the next
// tile only inside it.
template <int R, int N>
inline __attribute__((always_inline)) int64_t accumulate(const MatrixRef& w, int64_t r, int64_t r_end, const ActRef& a,
                                                         int j0, __m512 (&acc)[R][N]) {
  const int64_t K = w.cols;
  const float* x[N];  // (f32 / bf16 weights only: int4 in the q15 layout comes without an f32 copy)
  for (int j = 0; j < N; ++j) x[j] = a.f32 != nullptr ? a.f32 + (j0 + j) * a.stride : nullptr;
  int64_t k = 0;  // first column left for the scalar tail
  const RowPrefetch prefetch = row_prefetch(R, bytes_of(w, K), row_bytes_of(w), r + 2 * R <= r_end);
  const int64_t pf = prefetch.pf;
  if (w.format == WeightFormat::kInt4 && a.q15 != nullptr) {
    // The q15 layout (kernels.h), 128 columns (64 packed bytes, 4 groups) at a time: the low and the high
    // nibbles (the even and the odd columns) stay unsigned bytes that VPDPBUSD multiplies with the
    // activations' hi and lo bytes (dword lane d: packed bytes 4d .. 4d + 3, one lane of the layout);
    // 128 * hi_sum + lo_sum (lo_sum starting from the lane's -8 * sum q) is the exact integer (|.| < 2^22),
    // then one f32 FMA per lane scales it by its group's bf16 scale (dword d's high word <- scale d / 4)
    // times the lane's 2^-s. A last span of 1-3 groups loads masked (a column window of 32k columns).
    const __m512i low4 = _mm512_set1_epi8(0x0F), scale_idx = _mm512_load_si512(kQ15ScaleIdx);
    const uint8_t* row[R];
    const uint16_t* sc[R];
    const int8_t* xq[N];
    int4_rows<R>(w, r, row, sc);
    const int64_t S = a.q15_stream;
    for (int j = 0; j < N; ++j) xq[j] = a.q15 + (j0 + j) * kQ15Streams * S;
    // The q8 form (a.q8): q itself in the hi streams, one VPDPBUSD per nibble half from -8 * sum q.
    const auto span = [&](auto tail, auto q8, int64_t c, __mmask64 mb, __mmask16 ml,
                          __mmask8 mw) __attribute__((always_inline)) {
      constexpr bool kTail = decltype(tail)::value, kQ8 = decltype(q8)::value;
      const auto ld = [&](const void* p) __attribute__((always_inline)) {
        return kTail ? _mm512_maskz_loadu_epi8(mb, p) : _mm512_loadu_si512(p);
      };
      if (pf > 0) prefetch_rows<R>(row, c / 2, prefetch);  // a span is one line
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512i v = ld(row[i] + c / 2);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        const __m128i sw = kTail ? _mm_maskz_loadu_epi16(mw, sc[i] + c / 32)
                                 : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc[i] + c / 32));
        const __m512 scale =
            _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, scale_idx, _mm512_castsi128_si512(sw)));
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) {
          const int8_t* q = xq[j] + c / 2;
          const __m512 lane_scale = kTail ? _mm512_maskz_loadu_ps(ml, q + 5 * S) : _mm512_loadu_ps(q + 5 * S);
          if constexpr (kQ8) {
            const __m512i ncorr = kTail ? _mm512_maskz_loadu_epi32(ml, q + 4 * S) : _mm512_loadu_si512(q + 4 * S);
            __m512i s8 = _mm512_dpbusd_epi32(ncorr, lo, ld(q));
            s8 = _mm512_dpbusd_epi32(s8, hi, ld(q + S));
            acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s8), _mm512_mul_ps(scale, lane_scale), acc[i][j]);
            continue;
          }
          __m512i sh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ld(q));
          sh = _mm512_dpbusd_epi32(sh, hi, ld(q + S));
          __m512i sl = _mm512_dpbusd_epi32(kTail ? _mm512_maskz_loadu_epi32(ml, q + 4 * S) : _mm512_loadu_si512(q + 4 * S),
                                           lo, ld(q + 2 * S));
          sl = _mm512_dpbusd_epi32(sl, hi, ld(q + 3 * S));
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(sh, 7), sl)),
                                      _mm512_mul_ps(scale, lane_scale), acc[i][j]);
        }
      }
    };
    const auto spans = [&](auto q8) __attribute__((always_inline)) {
      int64_t c = 0;
      for (; c + 128 <= K; c += 128) span(std::false_type{}, q8, c, ~__mmask64{0}, 0xFFFF, 0xF);
      if (c < K) {
        const int g = static_cast<int>((K - c) / 32);  // 1-3 groups left (int4 columns come in groups)
        span(std::true_type{}, q8, c, (__mmask64{1} << (16 * g)) - 1, static_cast<__mmask16>((1u << (4 * g)) - 1),
             static_cast<__mmask8>((1u << g) - 1));
      }
    };
    if (a.q8)
      spans(std::true_type{});
    else
      spans(std::false_type{});
    k = K;
  } else if (w.format == WeightFormat::kInt4 && a.bf16_pair64 != nullptr && K % 64 == 0) {
    // Two groups (64 weights, 32 bytes) at a time: the bytes widen to 32 words; VPERMW of the words
    // (index: low 5 bits = low nibble + a repeated table) gives the even elements, of the words >> 4
    // the odd ones, each multiplied with the activations in pair64 order. Lanes 0-7 of the product
    // belong to the first group and 8-15 to the second: one vector of the two scales scales both.
    const __m512i table = _mm512_load_si512(kInt4Bf16), hi_word = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const uint8_t* row[R];
    const uint16_t* sc[R];
    const uint16_t* xp[N];
    int4_rows<R>(w, r, row, sc);
    for (int j = 0; j < N; ++j) xp[j] = a.bf16_pair64 + (j0 + j) * a.stride;
    for (int64_t s = 0; s < K / 64; ++s) {
      __m512bh xa[N], xb[N];
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) {
        xa[j] = (__m512bh)_mm512_loadu_si512(xp[j] + 64 * s);
        xb[j] = (__m512bh)_mm512_loadu_si512(xp[j] + 64 * s + 32);
      }
      if (pf > 0 && (s & 1) == 0) prefetch_rows<R>(row, 32 * s, prefetch);  // a line holds 2 spans
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[i] + 32 * s)));
        const __m512bh w_even = (__m512bh)_mm512_permutexvar_epi16(v, table);
        const __m512bh w_odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
        // dword = (scale of group 2s+1) << 16 | scale of group 2s: lanes 0-7 take the low word, 8-15 the high
        uint32_t pair;
        std::memcpy(&pair, sc[i] + 2 * s, 4);
        const __m512i sv = _mm512_set1_epi32(static_cast<int>(pair));
        const __m512 scale = _mm512_castsi512_ps(_mm512_mask_and_epi32(_mm512_slli_epi32(sv, 16), 0xFF00, sv, hi_word));
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) {
          const __m512 d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w_even, xa[j]), w_odd, xb[j]);
          acc[i][j] = _mm512_fmadd_ps(d, scale, acc[i][j]);
        }
      }
    }
    k = K;
  } else if (w.format == WeightFormat::kInt4 && a.bf16 != nullptr) {
    // bf16 activations: a group's 16 packed bytes widen to 16 dwords whose two nibbles become the
    // word indices (lo, hi) of a 16-entry bf16 table of q - 8 (exact in bf16), so each dword holds
    // the bf16 pair (w[2j], w[2j+1]) that VDPBF16PS multiplies with the pair (x[2j], x[2j+1]); the
    // group's fp32 partial sums are then scaled once per token.
    const __m512i table = _mm512_load_si512(kInt4Bf16);
    const uint8_t* row[R];
    const uint16_t* sc[R];
    const uint16_t* xh[N];
    int4_rows<R>(w, r, row, sc);
    for (int j = 0; j < N; ++j) xh[j] = a.bf16 + (j0 + j) * a.stride;
    for (int64_t g = 0; g < K / 32; ++g) {
      __m512bh xv[N];
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(xh[j] + 32 * g);
      if (pf > 0 && (g & 3) == 0) prefetch_rows<R>(row, 16 * g, prefetch);  // a line holds 4 groups
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        // dword j = byte j; OR-ing in (byte << 12) puts the high nibble in the dword's high word and
        // leaves the low word's low 5 bits (all VPERMW reads; the table repeats) the low nibble.
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[i] + 16 * g)));
        const __m512i idx = _mm512_or_si512(v, _mm512_slli_epi32(v, 12));
        const __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(idx, table);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi16(static_cast<short>(sc[i][g])), 16));
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j)
          acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wv, xv[j]), s, acc[i][j]);
      }
    }
    k = K;
  } else if (w.format == WeightFormat::kInt4) {
    const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const uint8_t* row[R];
    const uint16_t* sc[R];
    int4_rows<R>(w, r, row, sc);
    for (int64_t g = 0; g < K / 32; ++g) {
      if (pf > 0 && (g & 3) == 0) prefetch_rows<R>(row, 16 * g, prefetch);
      __m512 xa[N], xb[N];
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) {
        xa[j] = _mm512_loadu_ps(x[j] + 32 * g);
        xb[j] = _mm512_loadu_ps(x[j] + 32 * g + 16);
      }
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[i] + 16 * g));
        const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        // low nibble = even column: interleaving lo/hi bytes restores column order.
        const __m128i e0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
        const __m128i e1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
        const __m512 s = _mm512_set1_ps(bf16_to_f32(sc[i][g]));
        const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e0)), s);
        const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e1)), s);
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j)
          acc[i][j] = _mm512_fmadd_ps(w1, xb[j], _mm512_fmadd_ps(w0, xa[j], acc[i][j]));
      }
    }
    k = K;
  } else if (w.format == WeightFormat::kBF16 && a.bf16 != nullptr) {
    const uint16_t* row[R];
    const uint16_t* xh[N];
    for (int i = 0; i < R; ++i) row[i] = reinterpret_cast<const uint16_t*>(w.data) + (r + i) * w.ld;
    for (int j = 0; j < N; ++j) xh[j] = a.bf16 + (j0 + j) * a.stride;
    for (; k + 32 <= K; k += 32) {
      __m512bh xv[N];
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(xh[j] + k);
      if (pf > 0) prefetch_rows<R>(row, k, prefetch);  // 32 bf16 = one line
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(row[i] + k);
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
      }
    }
  } else if (w.format == WeightFormat::kBF16) {  // own loop: one with a per-load branch ran ~8% slower (dev box)
    const uint16_t* row[R];
    for (int i = 0; i < R; ++i) row[i] = reinterpret_cast<const uint16_t*>(w.data) + (r + i) * w.ld;
    for (; k + 16 <= K; k += 16) {
      if (pf > 0 && (k & 31) == 0) prefetch_rows<R>(row, k, prefetch);
      __m512 xv[N];
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) xv[j] = _mm512_loadu_ps(x[j] + k);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512 wv = load_bf16x16(row[i] + k);
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
      }
    }
  } else {
    const float* row[R];
    for (int i = 0; i < R; ++i) row[i] = reinterpret_cast<const float*>(w.data) + (r + i) * w.ld;
    for (; k + 16 <= K; k += 16) {
      __m512 xv[N];
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) xv[j] = _mm512_loadu_ps(x[j] + k);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512 wv = _mm512_loadu_ps(row[i] + k);
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
      }
    }
  }
  return k;
}

// The scalar tail of row r's dot with vector j of a from column k on (f32 / bf16 weights of odd widths only).
inline float tail_dot(const MatrixRef& w, int64_t r, int64_t k, const ActRef& a, int j) {
  float s = 0.f;
  for (int64_t kk = k; kk < w.cols; ++kk) s += dense_weight(w, r, kk) * a.f32[j * a.stride + kk];
  return s;
}

template <int R, int N>
void tile(const MatrixRef& w, int64_t r, int64_t r_end, const ActRef& a, int j0, float* out) {
  const int64_t K = w.cols;
  __m512 acc[R][N];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t k = accumulate<R, N>(w, r, r_end, a, j0, acc);
  if constexpr (R % 4 == 0) {
    if (k == K) {  // no tail: rows four at a time, one shuffle tree for the four sums
#pragma GCC unroll 16
      for (int i = 0; i < R; i += 4)
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) {
          alignas(16) float s[4];
          _mm_store_ps(s, reduce4(acc[i][j], acc[i + 1][j], acc[i + 2][j], acc[i + 3][j]));
          for (int q = 0; q < 4; ++q) out[(i + q) * a.n + j0 + j] = s[q];
        }
      return;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < N; ++j)  // (the tail: odd widths, f32 / bf16 only)
      out[i * a.n + j0 + j] = _mm512_reduce_add_ps(acc[i][j]) + tail_dot(w, r + i, k, a, j0 + j);
}

// out[i] = sum_m wts[m] * (W_m[r + i, :] . a_m), one token per matrix: each matrix's products accumulate in its own
// lanes, scaled into the sum's lanes by its weight; one shuffle tree per four rows at the end.
template <int R>
void tile_sum(const MatrixRef* ws, const ActRef* as, const float* wts, int n, int64_t r, int64_t r_end, float* out) {
  __m512 tot[R];
  float tail[R] = {};
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) tot[i] = _mm512_setzero_ps();
  for (int m = 0; m < n; ++m) {
    __m512 acc[R][1];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i][0] = _mm512_setzero_ps();
    const int64_t k = accumulate<R, 1>(ws[m], r, r_end, as[m], 0, acc);
    const __m512 wv = _mm512_set1_ps(wts[m]);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) tot[i] = _mm512_fmadd_ps(acc[i][0], wv, tot[i]);
    if (k < ws[m].cols)
      for (int i = 0; i < R; ++i) tail[i] += wts[m] * tail_dot(ws[m], r + i, k, as[m], 0);
  }
  if constexpr (R % 4 == 0) {
#pragma GCC unroll 16
    for (int i = 0; i < R; i += 4) {
      alignas(16) float s[4];
      _mm_store_ps(s, reduce4(tot[i], tot[i + 1], tot[i + 2], tot[i + 3]));
      for (int q = 0; q < 4; ++q) out[i + q] = s[q] + tail[i + q];
    }
  } else {
    for (int i = 0; i < R; ++i) out[i] = _mm512_reduce_add_ps(tot[i]) + tail[i];
  }
}

struct Avx512Tile {
  template <int R, int N>
  static void run(const MatrixRef& w, int64_t r, int64_t r_end, const ActRef& a, int j0, float* out) {
    tile<R, N>(w, r, r_end, a, j0, out);
  }
};
}  // namespace

void to_pair64_avx512(const uint16_t* x, int64_t K, uint16_t* dst) {
  // dst word p of a span <- x word e: p < 32 takes the even e = 4 (p >> 1) + 2 (p & 1), p >= 32 that + 1
  alignas(64) uint16_t idx[2][32];
  for (int p = 0; p < 32; ++p) idx[1][p] = static_cast<uint16_t>((idx[0][p] = static_cast<uint16_t>(4 * (p >> 1) + 2 * (p & 1))) + 1);
  const __m512i even = _mm512_load_si512(idx[0]), odd = _mm512_load_si512(idx[1]);
  for (int64_t s = 0; s < K; s += 64) {
    const __m512i a = _mm512_loadu_si512(x + s), b = _mm512_loadu_si512(x + s + 32);
    _mm512_storeu_si512(dst + s, _mm512_permutex2var_epi16(a, even, b));
    _mm512_storeu_si512(dst + s + 32, _mm512_permutex2var_epi16(a, odd, b));
  }
}

// The q15 layout and its q8 form, 16 columns (two lanes of 8) at a time: a lane's maximum or sum reaches every dword of
// its half by three XOR permutes; per lane, -8 * (sum of q) and the lane's scale go to streams 4 and 5.
struct QLanes {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i x4 = _mm512_xor_si512(iota, _mm512_set1_epi32(4)), x2 = _mm512_xor_si512(iota, _mm512_set1_epi32(2)),
                x1 = _mm512_xor_si512(iota, _mm512_set1_epi32(1));
  const __m512i lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0);  // dwords 0 and 8 first
  __m512i max(__m512i v) const {
    v = _mm512_max_epu32(v, _mm512_permutexvar_epi32(x4, v));
    v = _mm512_max_epu32(v, _mm512_permutexvar_epi32(x2, v));
    return _mm512_max_epu32(v, _mm512_permutexvar_epi32(x1, v));
  }
  // q's even and odd columns as bytes at `even` / `odd` (the qwords' low dwords are the even columns, VPMOVQB stores
  // their low bytes; >> 32 the odd ones)
  static void store_bytes(int8_t* even, int8_t* odd, __m512i q, bool two) {
    const __mmask8 mq = two ? 0xFF : 0x0F;
    _mm512_mask_cvtepi64_storeu_epi8(even, mq, q);
    _mm512_mask_cvtepi64_storeu_epi8(odd, mq, _mm512_srli_epi64(q, 32));
  }
  void store_lane_terms(int8_t* base, int64_t S, int64_t k, bool two, __m512i q, __m512 scale) const {
    __m512i sum = _mm512_add_epi32(q, _mm512_permutexvar_epi32(x4, q));
    sum = _mm512_add_epi32(sum, _mm512_permutexvar_epi32(x2, sum));
    sum = _mm512_add_epi32(sum, _mm512_permutexvar_epi32(x1, sum));
    const __m512i neg8 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 3));
    const __mmask16 ml = two ? 0x3 : 0x1;
    int32_t* const ncorr = reinterpret_cast<int32_t*>(base + 4 * S);
    _mm512_mask_storeu_epi32(ncorr + k / 8, ml, _mm512_permutexvar_epi32(lanes, neg8));
    _mm512_mask_storeu_ps(reinterpret_cast<float*>(base + 5 * S) + k / 8, ml, _mm512_permutexvar_ps(lanes, scale));
  }
};

void to_q15_avx512(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S) {
  // the lane's largest exponent field e (bf16 bits 7-14); x * 2^(140 - e) < 2^14 rounds to q (nearest even)
  const QLanes L;
  for (int64_t k = k0; k < k1; k += 16) {
    const bool two = k + 16 <= k1;
    const __m512i d = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(two ? 0xFFFF : 0x00FF, x + k));
    __m512i e = L.max(_mm512_and_si512(_mm512_srli_epi32(d, 7), _mm512_set1_epi32(0xFF)));
    e = _mm512_max_epu32(e, _mm512_set1_epi32(14));  // zero lanes (and subnormals, which round to 0)
    const __m512 up = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(267), e), 23));
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(d, 16)), up));
    const __m512i hi = _mm512_srai_epi32(q, 7), lo = _mm512_and_si512(q, _mm512_set1_epi32(127));
    QLanes::store_bytes(base + k / 2, base + S + k / 2, hi, two);
    QLanes::store_bytes(base + 2 * S + k / 2, base + 3 * S + k / 2, lo, two);
    __m512 ls = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(13)), 23));  // 2^(e - 140)
    ls = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), ls, _mm512_set1_ps(__builtin_nanf("")));
    L.store_lane_terms(base, S, k, two, q, ls);
  }
}

void to_q8_avx512(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S) {
  // the lane's largest magnitude m (as bits: the same order); q = round(x * (127 / m)) (|q| <= 127:
  // x * RN(127 / m) <= 127 (1 + 2^-24)); lanes with m < 2^-100 are zeros, a lane holding an inf or NaN scales by NaN
  const QLanes L;
  const __m512i tiny = _mm512_set1_epi32(27 << 7), inf = _mm512_set1_epi32(0x7F80);  // 2^-100, the exponent's top
  const __m512 k127 = _mm512_set1_ps(127.0f);
  for (int64_t k = k0; k < k1; k += 16) {
    const bool two = k + 16 <= k1;
    const __m512i d = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(two ? 0xFFFF : 0x00FF, x + k));
    const __m512i m = L.max(_mm512_and_si512(d, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 live = _mm512_cmpge_epu32_mask(m, tiny);
    const __m512 mf = _mm512_castsi512_ps(_mm512_slli_epi32(m, 16));
    const __m512 inv = _mm512_maskz_div_ps(live, k127, mf);
    const __m512i q = _mm512_maskz_cvtps_epi32(live, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(d, 16)), inv));
    QLanes::store_bytes(base + k / 2, base + S + k / 2, q, two);
    __m512 ls = _mm512_maskz_div_ps(live, mf, k127);
    ls = _mm512_mask_blend_ps(_mm512_cmpge_epu32_mask(m, inf), ls, _mm512_set1_ps(__builtin_nanf("")));
    L.store_lane_terms(base, S, k, two, q, ls);
  }
}

void pack_vnni_avx512(const uint16_t* xj, int64_t K, int64_t k0, int64_t k1, int n, int j, uint32_t* dst,
                      bool int4_order) {
  // per 32 columns: the words in position order (VPERMW by amx_int4_column, or as they are), then
  // its 16 dwords to dst[p * n + j] (a scatter); past K, zeros
  alignas(64) uint16_t col[32];
  alignas(64) uint32_t at[16];
  for (int e = 0; e < 32; ++e) col[e] = static_cast<uint16_t>(int4_order ? amx_int4_column(e) : e);
  for (int p = 0; p < 16; ++p) at[p] = static_cast<uint32_t>(p * n);
  const __m512i perm = _mm512_load_si512(col), offsets = _mm512_load_si512(at);
  for (int64_t k = k0; k < k1; k += 32) {
    const __mmask32 in_k = K - k >= 32 ? ~__mmask32{0} : K > k ? (__mmask32{1} << (K - k)) - 1 : 0;
    const __m512i v = _mm512_permutexvar_epi16(perm, _mm512_maskz_loadu_epi16(in_k, xj + k));
    _mm512_i32scatter_epi32(dst + k / 2 * n + j, offsets, v, 4);
  }
}

// The lines of a call's first tile (rows r0 .. r0 + tile_rows - 1), `bytes` of each row from its window's start.
inline void prefetch_first_tile(const MatrixRef& w, int64_t r0, int64_t r1, int64_t tile_rows, int64_t row_bytes,
                                int64_t bytes) {
  for (int64_t r = r0; r < std::min(r1, r0 + tile_rows); ++r) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(w.data) + r * row_bytes;
    for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}

// A call's start: its first tile's lines, for short rows (window_prefetch(false): whole strides, as before) and, with
// tile_prefetch, the first prefetch distance of long rows.
inline void prefetch_call_start(const MatrixRef& w, int64_t r0, int64_t r1, int64_t tile_rows) {
  const int64_t row_bytes = row_bytes_of(w), window = bytes_of(w, w.cols);
  if (prefetch_bytes() > 0 && row_bytes <= short_row_bytes())
    prefetch_first_tile(w, r0, r1, tile_rows, row_bytes, window_prefetch() ? window : row_bytes);
  else if (prefetch_bytes() > 0 && tile_prefetch())
    prefetch_first_tile(w, r0, r1, tile_rows, row_bytes, std::min(prefetch_bytes(), window));
}

// One token on int4 rows in the q15 layout: tiles of 8 rows (their per-tile work, the sums' shuffle tree and the
// pointers, over twice the rows; dev box, one core, 1 MiB of int4 in K = 512 / 256 rows: 23.4 -> 18.9 / 30.5 ->
// 25.0 us; 16 rows spill). Otherwise 4 rows x up to 4 tokens.
inline bool rows8(const MatrixRef& w, const ActRef& a) {
  return w.format == WeightFormat::kInt4 && a.q15 != nullptr && a.n == 1;
}

void dot_rows_sum_avx512bf16(const MatrixRef* ws, const ActRef* as, const float* wts, int n, int64_t r0, int64_t r1,
                             float* out) {
  bool all8 = true;
  for (int m = 0; m < n; ++m) all8 = all8 && rows8(ws[m], as[m]);
  const int64_t R = all8 ? 8 : 4;
  for (int m = 0; m < n; ++m) prefetch_call_start(ws[m], r0, r1, R);
  int64_t r = r0;
  if (all8)
    for (; r + 8 <= r1; r += 8) tile_sum<8>(ws, as, wts, n, r, r1, out + (r - r0));
  else
    for (; r + 4 <= r1; r += 4) tile_sum<4>(ws, as, wts, n, r, r1, out + (r - r0));
  for (; r < r1; ++r) tile_sum<1>(ws, as, wts, n, r, r1, out + (r - r0));
}

void dot_rows_avx512bf16(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out) {
  const bool r8 = rows8(w, a);
  prefetch_call_start(w, r0, r1, r8 ? 8 : 4);
  if (r8) return dot_rows_tiled<Avx512Tile, 8, 1>(w, r0, r1, a, out);
  dot_rows_tiled<Avx512Tile, 4, 4>(w, r0, r1, a, out);
}

namespace {
struct Avx512Ops {
  using V = __m512;
  static constexpr int kW = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) { return load_bf16x16(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
};
}  // namespace

void axpy_rows_avx512(const MatrixRef& w, int64_t i0, int64_t i1, const float* const* c, int n, int64_t h0,
                      int64_t h1, float* const* out) {
  // 8 accumulators + 16 coefficients + 2 weights of 32 zmm
  axpy_rows_tiled<Avx512Ops, 4>(w, i0, i1, c, n, h0, h1, out);
}

}  // namespace ftjax
