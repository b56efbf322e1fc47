// AVX2 + FMA tier: 8-lane version of the AVX-512 tier (bf16 widened to f32, int4 unpacked in
// registers); bf16 activations use their exact f32 copies (no bf16 dot product before AVX-512), except for int4
// weights in the q15 layout (integer products, as the AVX-512 VNNI loop).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "kernels_axpy.h"
#include "kernels_tiling.h"

namespace ftjax {
namespace {

inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// acc[i][j] += the lanes of int4 rows r .. r + R - 1 times activations j0 .. j0 + N - 1 in the q15 layout (kernels.h) or
// its q8 form, 64 columns (32 packed bytes, 2 groups, 8 lanes) at a time. VPDPBUSD as VPMADDUBSW (the nibbles, unsigned,
// times the activations' bytes: each word sums two products, |.| <= 2 * 15 * 128) and VPMADDWD: two nibble halves add
// in words first (|.| <= 7,680), then the words' pairs into the lane's dword; 128 * hi + lo from -8 * sum q is the
// lane's exact integer, scaled by its group's bf16 scale times the lane's. A last group alone goes in 16-byte halves.
template <bool kQ8, int R, int N>
inline void accumulate_q(const MatrixRef& w, int64_t r, const ActRef& a, int j0, __m256 (&acc)[R][N]) {
  const int64_t K = w.cols, S = a.q15_stream;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), k128 = _mm256_set1_epi16(128);
  const uint8_t* row[R];
  const uint16_t* sc[R];
  int4_rows<R>(w, r, row, sc);
  const int8_t* xq[N];
  for (int j = 0; j < N; ++j) xq[j] = a.q15 + (j0 + j) * kQ15Streams * S;
  const auto span = [&](auto tail, int64_t c) __attribute__((always_inline)) {
    constexpr bool kTail = decltype(tail)::value;  // one group: the low 16 bytes and 4 lanes only
    const __m256i lanes4 = _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0);
    const auto ld = [&](const void* p) __attribute__((always_inline)) {
      return kTail ? _mm256_zextsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(p)))
                   : _mm256_loadu_si256(static_cast<const __m256i*>(p));
    };
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m256i v = ld(row[i] + c / 2);
      const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      __m256 scale;  // lanes 0-3: group c / 32's scale, 4-7 the next group's
      if constexpr (kTail) {
        scale = _mm256_set1_ps(bf16_to_f32(sc[i][c / 32]));
      } else {
        uint32_t pair;
        std::memcpy(&pair, sc[i] + c / 32, 4);
        const __m256i sv = _mm256_set1_epi32(static_cast<int>(pair));
        scale = _mm256_castsi256_ps(_mm256_blend_epi32(_mm256_slli_epi32(sv, 16),
                                                       _mm256_and_si256(sv, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))),
                                                       0xF0));
      }
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) {
        const int8_t* q = xq[j] + c / 2;
        const __m256i ncorr = kTail ? _mm256_maskload_epi32(reinterpret_cast<const int*>(q + 4 * S), lanes4)
                                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 4 * S));
        const __m256 lane_scale = kTail ? _mm256_maskload_ps(reinterpret_cast<const float*>(q + 5 * S), lanes4)
                                        : _mm256_loadu_ps(reinterpret_cast<const float*>(q + 5 * S));
        const __m256i sh = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ld(q)), _mm256_maddubs_epi16(hi, ld(q + S)));
        __m256i s;
        if constexpr (kQ8) {  // (the q8 form: q itself in the hi streams)
          s = _mm256_add_epi32(_mm256_madd_epi16(sh, ones), ncorr);
        } else {
          const __m256i sl = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ld(q + 2 * S)),
                                              _mm256_maddubs_epi16(hi, ld(q + 3 * S)));
          s = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(sh, k128), _mm256_madd_epi16(sl, ones)), ncorr);
        }
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, lane_scale), acc[i][j]);
      }
    }
  };
  int64_t c = 0;
  for (; c + 64 <= K; c += 64) span(std::false_type{}, c);
  if (c < K) span(std::true_type{}, c);  // (K % 32 == 0: one group left)
}

template <int R, int N>
void tile(const MatrixRef& w, int64_t r, const ActRef& a, int j0, float* out) {
  const int64_t K = w.cols;
  __m256 acc[R][N];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* x[N];  // (int4 in the q15 layout comes without an f32 copy)
  for (int j = 0; j < N; ++j) x[j] = a.f32 != nullptr ? a.f32 + (j0 + j) * a.stride : nullptr;
  int64_t k = 0;
  if (w.format == WeightFormat::kInt4 && a.q15 != nullptr) {
    if (a.q8)
      accumulate_q<true, R, N>(w, r, a, j0, acc);
    else
      accumulate_q<false, R, N>(w, r, a, j0, acc);
    k = K;
  } else if (w.format == WeightFormat::kInt4) {
    const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const uint8_t* row[R];
    const uint16_t* sc[R];
    int4_rows<R>(w, r, row, sc);
    for (int64_t g = 0; g < K / 32; ++g) {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[i] + 16 * g));
        const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        const __m128i e0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);  // columns 0..15
        const __m128i e1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);  // columns 16..31
        const __m256 s = _mm256_set1_ps(bf16_to_f32(sc[i][g]));
        const __m256 w0 = _mm256_mul_ps(i8x8_to_ps(e0), s);
        const __m256 w1 = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(e0, 8)), s);
        const __m256 w2 = _mm256_mul_ps(i8x8_to_ps(e1), s);
        const __m256 w3 = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(e1, 8)), s);
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) {
          const float* xj = x[j] + 32 * g;
          __m256 t = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xj), acc[i][j]);
          t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xj + 8), t);
          t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xj + 16), t);
          acc[i][j] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xj + 24), t);
        }
      }
    }
    k = K;
  } else {
    const bool bf16 = w.format == WeightFormat::kBF16;
    for (; k + 8 <= K; k += 8) {
      __m256 xv[N];
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) xv[j] = _mm256_loadu_ps(x[j] + k);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m256 wv = bf16 ? load_bf16x8(reinterpret_cast<const uint16_t*>(w.data) + (r + i) * w.ld + k)
                               : _mm256_loadu_ps(reinterpret_cast<const float*>(w.data) + (r + i) * w.ld + k);
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < N; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) {
        s += dense_weight(w, r + i, kk) * x[j][kk];
      }
      out[i * a.n + j0 + j] = s;
    }
  }
}

struct Avx2Tile {
  template <int R, int N>
  static void run(const MatrixRef& w, int64_t r, int64_t /*r_end*/, const ActRef& a, int j0, float* out) {
    tile<R, N>(w, r, a, j0, out);
  }
};
}  // namespace

namespace {
// The q15 layout and its q8 form (kernels.h) a lane of 8 columns at a time, byte for byte those of the AVX-512 writers.
__m256i lane_max(__m256i v) {  // the lane's largest (unsigned), in every dword
  v = _mm256_max_epu32(v, _mm256_permute2x128_si256(v, v, 1));
  v = _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0x4E));
  return _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0xB1));
}

// q's low bytes: the even columns' at `even`, the odd columns' at `odd`. Per 128-bit half the shuffle puts the bytes of
// q0 q2 q1 q3 (q4 q6 q5 q7) in its first dword; the halves' words interleave into even | odd.
void store_bytes(int8_t* even, int8_t* odd, __m256i q) {
  const __m256i pick = _mm256_setr_epi8(0, 8, 4, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 8, 4, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(q, pick);
  const __m128i u = _mm_unpacklo_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  const int32_t e = _mm_cvtsi128_si32(u), o = _mm_extract_epi32(u, 1);
  std::memcpy(even, &e, 4);
  std::memcpy(odd, &o, 4);
}

// -8 * (sum of the lane's q) and its scale: byte 4 * (k / 8) = k / 2 of streams 4 and 5 (wrapping sums: a lane with an
// inf or NaN has undefined q)
void store_terms(int8_t* base, int64_t S, int64_t k, __m256i q, float scale) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  const uint32_t ncorr = 0u - 8u * static_cast<uint32_t>(_mm_cvtsi128_si32(s));
  std::memcpy(base + 4 * S + k / 2, &ncorr, 4);
  std::memcpy(base + 5 * S + k / 2, &scale, 4);
}

inline __m256i widen_bf16(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float f32_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
}  // namespace

void to_q15_avx2(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S) {
  // the lane's largest exponent field e (at least 14: zeros and subnormals round to 0); x * 2^(140 - e) rounds to q
  for (int64_t k = k0; k < k1; k += 8) {
    const __m256i d = widen_bf16(x + k);
    const __m256i e = _mm256_max_epu32(lane_max(_mm256_and_si256(_mm256_srli_epi32(d, 7), _mm256_set1_epi32(0xFF))),
                                       _mm256_set1_epi32(14));
    const __m256 up = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(267), e), 23));
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(d, 16)), up));
    store_bytes(base + k / 2, base + S + k / 2, _mm256_srai_epi32(q, 7));
    store_bytes(base + 2 * S + k / 2, base + 3 * S + k / 2, _mm256_and_si256(q, _mm256_set1_epi32(127)));
    const uint32_t el = static_cast<uint32_t>(_mm256_cvtsi256_si32(e));
    store_terms(base, S, k, q, el == 255 ? __builtin_nanf("") : f32_bits((el - 13) << 23));  // 2^(e - 140)
  }
}

void to_q8_avx2(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S) {
  // the lane's largest magnitude m (as bits); q = round(x * (127 / m)); lanes with m < 2^-100 are zeros
  for (int64_t k = k0; k < k1; k += 8) {
    const __m256i d = widen_bf16(x + k);
    const __m256i m = lane_max(_mm256_and_si256(d, _mm256_set1_epi32(0x7FFF)));
    const __m256i live = _mm256_cmpgt_epi32(m, _mm256_set1_epi32((27 << 7) - 1));
    const __m256 mf = _mm256_castsi256_ps(_mm256_slli_epi32(m, 16));
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(127.0f), mf), _mm256_castsi256_ps(live));
    const __m256i q = _mm256_and_si256(
        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(d, 16)), inv)), live);
    store_bytes(base + k / 2, base + S + k / 2, q);
    const uint32_t ml = static_cast<uint32_t>(_mm256_cvtsi256_si32(m));
    const float scale = _mm256_cvtss_f32(_mm256_and_ps(_mm256_div_ps(mf, _mm256_set1_ps(127.0f)), _mm256_castsi256_ps(live)));
    store_terms(base, S, k, q, ml >= 0x7F80 ? __builtin_nanf("") : scale);
  }
}

void dot_rows_avx2(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out) {
  // 12 accumulators + 3 activations + 1 weight of 16 ymm
  dot_rows_tiled<Avx2Tile, 4, 3>(w, r0, r1, a, out);
}

namespace {
struct Avx2Ops {
  using V = __m256;
  static constexpr int kW = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) { return load_bf16x8(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V fma(V a, V b, V acc) { return _mm256_fmadd_ps(a, b, acc); }
};
}  // namespace

void axpy_rows_avx2(const MatrixRef& w, int64_t i0, int64_t i1, const float* const* c, int n, int64_t h0,
                    int64_t h1, float* const* out) {
  // 4 accumulators + 8 coefficients + 2 weights of 16 ymm
  axpy_rows_tiled<Avx2Ops, 2>(w, i0, i1, c, n, h0, h1, out);
}

}  // namespace ftjax
