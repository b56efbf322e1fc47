// The amx8 path: int4 weights times bf16 activations on AMX-INT8. The nibbles less 8 become signed bytes of an A tile
// (16 weight rows x 32 columns, one group); the activations come as 15-bit integers per group (the amx8 layout,
// kernels.h: q = 128 h + l) in the columns of the B tiles, h and l of each token apart, and of up to 8 groups apart
// when few tokens leave columns free; TDPBSSD sums each group's exact integer products per column, and one f32 FMA
// per weight row and C tile scales them by the group's bf16 scale and the activations' power of two. Against the q15
// loop (kernels_avx512.cc), which spends ~9 vector instructions per token per 128 weights, the vector work here is
// the expansion (2 per 64 weights a row, shared by the tokens) and 3 per row per C tile.
// The tile unit is reached through a policy: the instructions (HwTiles), or a scalar model of them (ModelTiles) on
// which CI checks the layouts and the pipeline on machines without AMX.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "amx_tiles.h"
#include "kernels.h"

namespace ftjax {
std::atomic<int> g_amx8_probe{0};  // TEMPORARY (session 29 diagnosis): 1 no expansion, 2 no products, 4 no C tiles, 8 / 16 staging depth 3 / 4
namespace {

// GCC's tile intrinsics are macros that paste the tile number into the instruction: each number is spelled out.
#define FTJAX_TILES(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
struct HwTiles {
  static void config(const TileConfig& c) {
    publish(&c);
    _tile_loadconfig(&c);
  }
  template <int T>
  static void zero() {
#define FTJAX_ZERO(n) \
  if constexpr (T == n) _tile_zero(n);
    FTJAX_TILES(FTJAX_ZERO)
#undef FTJAX_ZERO
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
#define FTJAX_LOAD(n) \
  if constexpr (T == n) _tile_loadd(n, p, stride);
    FTJAX_TILES(FTJAX_LOAD)
#undef FTJAX_LOAD
  }
  template <int T>
  static void store(void* p, int64_t stride) {
#define FTJAX_STORE(n) \
  if constexpr (T == n) _tile_stored(n, p, stride);
    FTJAX_TILES(FTJAX_STORE)
#undef FTJAX_STORE
  }
  template <int C, int A, int B>
  static void dp() {  // the C tiles 0, 1, 3, 6 with the A / B pairs 2 / 4 and 5 / 7
    static_assert((A == 2 && B == 4) || (A == 5 && B == 7));
#define FTJAX_DP(c)                                         \
  if constexpr (C == c && A == 2) _tile_dpbssd(c, 2, 4);    \
  if constexpr (C == c && A == 5) _tile_dpbssd(c, 5, 7);
    FTJAX_DP(0) FTJAX_DP(1) FTJAX_DP(3) FTJAX_DP(6)
#undef FTJAX_DP
  }
};
#undef FTJAX_TILES

// The tiles as memory: rows and bytes per row as configured, TILELOADD zeroing what the configuration leaves out,
// TDPBSSD: C[m][n] += sum over k < colsb(A) / 4, b < 4 of A[m][4k + b] * B[k][4n + b] (signed bytes, int32 sums).
struct ModelTiles {
  struct State {
    TileConfig cfg;
    alignas(64) int8_t t[8][16][64];
  };
  static State& s() {
    thread_local State st;
    return st;
  }
  static void config(const TileConfig& c) {
    s().cfg = c;
    std::memset(s().t, 0, sizeof s().t);
  }
  template <int T>
  static void zero() { std::memset(s().t[T], 0, sizeof s().t[T]); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    State& st = s();
    std::memset(st.t[T], 0, sizeof st.t[T]);
    for (int r = 0; r < st.cfg.rows[T]; ++r)
      std::memcpy(st.t[T][r], static_cast<const char*>(p) + r * stride, st.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    State& st = s();
    for (int r = 0; r < st.cfg.rows[T]; ++r) std::memcpy(static_cast<char*>(p) + r * stride, st.t[T][r], st.cfg.colsb[T]);
  }
  template <int C, int A, int B>
  static void dp() {
    State& st = s();
    for (int m = 0; m < st.cfg.rows[A]; ++m)
      for (int n = 0; n < st.cfg.colsb[B] / 4; ++n) {
        int32_t acc;
        std::memcpy(&acc, &st.t[C][m][4 * n], 4);
        for (int k = 0; k < st.cfg.colsb[A] / 4; ++k)
          for (int b = 0; b < 4; ++b) acc += int32_t{st.t[A][m][4 * k + b]} * int32_t{st.t[B][k][4 * n + b]};
        std::memcpy(&st.t[C][m][4 * n], &acc, 4);
      }
  }
};

// C tiles tmm0/1/3/6 (16 rows x 16 int32 columns); A tiles tmm2 / tmm5 (16 rows x 32 bytes: one group), B tiles
// tmm4 / tmm7 (8 rows x 64 bytes), alternating by group so that a load overlaps the previous group's product.
constexpr int kCTile[4] = {0, 1, 3, 6};
TileConfig amx8_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t == 4 || t == 7 ? 8 : 16;
    cfg.colsb[t] = t == 2 || t == 5 ? 32 : 64;
  }
  return cfg;
}

// VPERMB table: byte i -> (i & 15) - 8; VPERMB reads 6 index bits, the table repeats every 16, so a nibble's
// neighbouring bits above it never matter.
alignas(64) constexpr int8_t kNibbleLess8[64] = {
    -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7,
    -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

// One block of 16 int4 rows times one block of nb tokens, GP groups per C tile (amx8_groups_per_step(nb)). Groups
// go in batches (8, or 4 when each group needs its own C tile), software-pipelined over two staging buffers as the
// AMX int4 tiles are (kernels_amx.cc): batch t's products are issued, then the vector work that does not wait on
// them (expanding batch t + 1, scaling batch t - 1 from its stored C tiles), then batch t's C tiles are stored.
template <class T, int GP>
struct Amx8Block {
  static constexpr int kBatch = GP == 1 ? 4 : 8;  // groups per batch
  static constexpr int kSteps = kBatch / GP;      // C tiles per batch

  template <int Q>
  static inline __attribute__((always_inline)) void products(int ng, int8_t (*ab)[16][64], const int8_t* lay) {
    if constexpr (Q < kBatch) {
      if (Q < ng) {
        constexpr int c = kCTile[Q / GP], at = Q & 1 ? 5 : 2, bt = Q & 1 ? 7 : 4;
        if constexpr (Q % GP == 0) T::template zero<c>();
        T::template load<at>(&ab[Q / 2][0][32 * (Q & 1)], 64);
        T::template load<bt>(lay + Q * kAmx8GroupBytes, 64);
        T::template dp<c, at, bt>();
        products<Q + 1>(ng, ab, lay);
      }
    }
  }
  template <int S>
  static inline __attribute__((always_inline)) void stores(int steps, int32_t (*cb)[16][16]) {
    if constexpr (S < kSteps) {
      if (S < steps) {
        T::template store<kCTile[S]>(cb[S][0], 64);
        stores<S + 1>(steps, cb);
      }
    }
  }

  // out[i * n + t] for rows r .. r + 15 and tokens t < nb of the block at lay (the window's first group; its index
  // in the layout g_abs0).
  static void run(const MatrixRef& w, int64_t r, const int8_t* lay, int nb, int64_t g_abs0, float* out, int n,
                   int64_t pf) {
    const int64_t G = w.cols / 32, rb = w.ld / 2, sc_stride = w.ld / 32;
    const uint8_t* rows = w.data + r * rb;
    const uint16_t* sc = w.scales + r * sc_stride;
    const int64_t stop = prefetch_stop(pf, 16 * G, rb);
    // the rows' group scales in f32, [16][Gs]: a step's lanes load 16 from its first group on
    const int64_t Gs = (G + 31) / 16 * 16;
    thread_local std::vector<float> sfv;
    if (sfv.size() < static_cast<size_t>(16 * Gs + 16)) sfv.resize(16 * Gs + 16);
    float* sf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sfv.data()) + 63) & ~uintptr_t{63});
    for (int i = 0; i < 16; ++i)
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 m = G - g >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (G - g)) - 1);
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, sc + i * sc_stride + g));
        _mm512_storeu_si512(sf + i * Gs + g, _mm512_slli_epi32(v, 16));
      }
    // lane c of a C tile (slot c / (2 nb)) belongs to the step's group (slot - g_abs0) mod GP (steps start on
    // multiples of GP from the window's start); lanes past GP * 2 nb hold zeros (and factors 0)
    alignas(64) int32_t lane_q[16];
    for (int c = 0; c < 16; ++c) {
      const int slot = c < GP * 2 * nb ? c / (2 * nb) : 0;
      lane_q[c] = static_cast<int>(((slot - g_abs0) % GP + GP) % GP);
    }
    const __m512i lane_group = _mm512_load_si512(lane_q), table = _mm512_load_si512(kNibbleLess8);
    const int64_t shift4 = 0x0004000400040004;
    const __m512i shifts = _mm512_set_epi64(shift4, shift4, 0, 0, shift4, shift4, 0, 0);  // 128-bit lanes 0, 4, 0, 4
    const int probe = g_amx8_probe.load(std::memory_order_relaxed);
    alignas(64) int8_t abuf[4][kBatch / 2][16][64];
    const int depth = probe & 16 ? 4 : probe & 8 ? 3 : 2;  // staging buffers: batches expanded depth - 1 ahead
    alignas(64) int32_t cbuf[2][kSteps][16][16];  // (every column stored: no stale lanes)
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t batches = (G + kBatch - 1) / kBatch;
    // Group pair p's 32 packed bytes a row, broadcast as 128-bit lanes P0 P0 P1 P1, shifted by 0 4 0 4 bits per word
    // and looked up: A-tile bytes [low nibbles of group 2p (its even columns), high nibbles, the same of 2p + 1].
    const auto expand = [&](int64_t t) __attribute__((always_inline)) {
      if (probe & 1) return;
      const int64_t p0 = t * kBatch / 2, p1 = std::min<int64_t>(p0 + kBatch / 2, (G + 1) / 2);
      for (int64_t p = p0; p < p1; ++p) {
        const bool half = 2 * p + 1 == G;
        if (pf > 0 && (p & 1) == 0 && 32 * p < stop)
          for (int i = 0; i < 16; ++i) _mm_prefetch(reinterpret_cast<const char*>(rows + i * rb + 32 * p) + pf, _MM_HINT_T0);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const uint8_t* src = rows + i * rb + 32 * p;
          const __m256i v = half ? _mm256_maskz_loadu_epi8(0xFFFF, src) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          __m512i z = _mm512_castsi256_si512(v);
          z = _mm512_srlv_epi16(_mm512_shuffle_i64x2(z, z, 0x50), shifts);
          _mm512_store_si512(abuf[t % depth][p - p0][i], _mm512_permutexvar_epi8(z, table));
        }
      }
    };
    const auto scale = [&](int64_t t) __attribute__((always_inline)) {
      if (probe & 4) return;
      const int64_t gb = t * kBatch;
      const int steps = static_cast<int>((std::min<int64_t>(kBatch, G - gb) + GP - 1) / GP);
      for (int st = 0; st < steps; ++st) {
        const int64_t gs = gb + st * GP;
        __m512 f = _mm512_loadu_ps(reinterpret_cast<const float*>(lay + gs * kAmx8GroupBytes + 512));
        for (int64_t q = 1; q < std::min<int64_t>(GP, G - gs); ++q)
          f = _mm512_add_ps(f, _mm512_loadu_ps(reinterpret_cast<const float*>(lay + (gs + q) * kAmx8GroupBytes + 512)));
        const int32_t(*cb)[16] = cbuf[t & 1][st];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const __m512 s = GP == 1 ? _mm512_set1_ps(sf[i * Gs + gs])
                                   : _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(sf + i * Gs + gs));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[i])), _mm512_mul_ps(f, s), acc[i]);
        }
      }
    };
    for (int64_t t = 0; t < std::min<int64_t>(depth - 1, batches); ++t) expand(t);
    for (int64_t t = 0; t < batches; ++t) {
      publish(abuf);
      const int ng = static_cast<int>(std::min<int64_t>(kBatch, G - t * kBatch));
      if (!(probe & 2)) products<0>(ng, abuf[t % depth], lay + t * kBatch * kAmx8GroupBytes);
      if (t + depth - 1 < batches) expand(t + depth - 1);
      if (t > 0) scale(t - 1);
      if (!(probe & 4)) stores<0>((ng + GP - 1) / GP, cbuf[t & 1]);
      publish(cbuf);
    }
    scale(batches - 1);
    alignas(64) float res[16][16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm512_store_ps(res[i], acc[i]);
    for (int i = 0; i < 16; ++i)
      for (int t = 0; t < nb; ++t) {
        float v = 0.f;
        for (int slot = 0; slot < GP; ++slot) v += res[i][slot * 2 * nb + 2 * t] + res[i][slot * 2 * nb + 2 * t + 1];
        out[i * n + t] = v;
      }
  }
};

template <class T>
void dot_rows_int8(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out) {
  const int64_t r_amx = r0 + (r1 - r0) / 16 * 16, pf = prefetch_bytes();
  if (r_amx > r0) T::config(amx8_config());
  for (int j0 = 0; j0 < a.n && r_amx > r0; j0 += kAmx8BlockTokens) {
    const int nb = std::min(kAmx8BlockTokens, a.n - j0);
    const int8_t* lay = a.amx8 + j0 / kAmx8BlockTokens * a.amx8_block;
    const int gp = amx8_groups_per_step(nb);
    const auto run = gp == 8 ? Amx8Block<T, 8>::run : gp == 4 ? Amx8Block<T, 4>::run
                                                      : gp == 2 ? Amx8Block<T, 2>::run : Amx8Block<T, 1>::run;
    for (int64_t r = r0; r < r_amx; r += 16) run(w, r, lay, nb, a.amx8_group0, out + (r - r0) * a.n + j0, a.n, pf);
  }
  if (r_amx < r1) {  // the AVX-512 tier's bf16 loop for the last rows
    ActRef b = a;
    b.amx8 = nullptr;
    dot_rows_avx512bf16(w, r_amx, r1, b, out + (r_amx - r0) * a.n);
  }
}
}  // namespace

void pack_amx8(const uint16_t* const* xs, int nb, int64_t c0, int64_t c1, int8_t* dst) {
  // Per group and vector: 32 bf16 widened to dwords, the largest exponent field e (at least 14, as q15), q =
  // round(x 2^(140 - e)) (|q| < 2^14), its even columns then its odd ones (A-tile column order), h = q >> 7 and
  // l = q & 127 narrowed to bytes, written as B-tile column dwords (4 A-tile columns each, 8 rows).
  const int gp = amx8_groups_per_step(nb);
  alignas(64) int32_t idx[2][16];
  for (int i = 0; i < 16; ++i) idx[1][i] = (idx[0][i] = 2 * i) + 1;
  const __m512i even = _mm512_load_si512(idx[0]), odd = _mm512_load_si512(idx[1]), ff = _mm512_set1_epi32(0xFF);
  for (int64_t g = c0 / 32; g < c1 / 32; ++g) {
    int8_t* tile = dst + g * kAmx8GroupBytes;
    float* f = reinterpret_cast<float*>(tile + 512);
    std::memset(tile, 0, kAmx8GroupBytes);
    const int slot = static_cast<int>(g % gp);
    for (int t = 0; t < nb; ++t) {
      const uint16_t* x = xs[t] + 32 * g;
      const __m512i d0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      const __m512i d1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
      const __m512i ex = _mm512_max_epu32(_mm512_and_si512(_mm512_srli_epi32(d0, 7), ff),
                                          _mm512_and_si512(_mm512_srli_epi32(d1, 7), ff));
      const int e = std::max<int>(14, static_cast<int>(_mm512_reduce_max_epu32(ex)));
      const int col = slot * 2 * nb + 2 * t;
      if (e == 255) {  // an inf or NaN: the group's product is NaN (its B columns stay zero)
        f[col] = f[col + 1] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const __m512 up = _mm512_castsi512_ps(_mm512_set1_epi32((267 - e) << 23));  // 2^(140 - e)
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(d0, 16)), up));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(d1, 16)), up));
      const __m512i qe = _mm512_permutex2var_epi32(q0, even, q1), qo = _mm512_permutex2var_epi32(q0, odd, q1);
      const __m512i low7 = _mm512_set1_epi32(127);
      alignas(16) int8_t h[32], l[32];
      _mm_store_si128(reinterpret_cast<__m128i*>(h), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qe, 7)));
      _mm_store_si128(reinterpret_cast<__m128i*>(h + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qo, 7)));
      _mm_store_si128(reinterpret_cast<__m128i*>(l), _mm512_cvtepi32_epi8(_mm512_and_si512(qe, low7)));
      _mm_store_si128(reinterpret_cast<__m128i*>(l + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(qo, low7)));
      for (int k4 = 0; k4 < 8; ++k4) {
        std::memcpy(tile + 64 * k4 + 4 * col, h + 4 * k4, 4);
        std::memcpy(tile + 64 * k4 + 4 * (col + 1), l + 4 * k4, 4);
      }
      float ls;
      const int32_t bits = (e - 13) << 23;  // 2^(e - 140)
      std::memcpy(&ls, &bits, 4);
      f[col] = 128.f * ls;
      f[col + 1] = ls;
    }
  }
}

void dot_rows_amx8(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out) {
  if (a.amx8 == nullptr || a.bf16 == nullptr || w.format != WeightFormat::kInt4)
    throw std::logic_error("dot_rows_amx8: int4 weights with the amx8 layout and the bf16 vectors only");
  count_amx_route(AmxRoute::kAmx8);
  if (amx8_emulate()) return dot_rows_int8<ModelTiles>(w, r0, r1, a, out);
  if (!amx_enable()) throw std::runtime_error("dot_rows_amx8: the kernel refused this process the AMX tile state");
  dot_rows_int8<HwTiles>(w, r0, r1, a, out);
}

}  // namespace ftjax
