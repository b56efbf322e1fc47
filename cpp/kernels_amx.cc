// AMX tier (AMX-TILE + AMX-BF16): bf16 or int4 weights times bf16 activations on the tile unit
// with TDPBF16PS (bf16 pair products summed in fp32, like VDPBF16PS); int4 groups expand to exact
// bf16 (q - 8) in L1 and each group's product is scaled in fp32. Every other case - f32 weights,
// f32 activations, K < 32, int4 without pre-packed activations, the rows past the last full block
// of 16 - goes to the AVX-512-BF16 tier unchanged.
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

// LDTILECFG's 64-byte operand, palette 1. Tiles are not renamed: a tile load waits until the
// previous product has read that tile, so the k-steps alternate between two sets of A and B tiles
// (even steps: A tmm2 (tmm3), B tmm4; odd steps: A tmm5 (tmm6), B tmm7) and the load of one step
// overlaps the product of the other. C: tmm0 (and tmm1), 16 weight rows x nb fp32; A: 16 weight
// rows x 32 bf16; B: 16 k-pairs x nb tokens x 2 bf16.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Loaded on every call (cheap against the 16 x K weight rows a call reads): other code on the same
// thread (oneDNN inside XLA or torch) may reconfigure or release the tiles between our calls.
void configure(int nb, bool int4 = false) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    const bool a_tile = int4 ? t == 2 || t == 5 : t == 2 || t == 3 || t == 5 || t == 6;
    cfg.colsb[t] = static_cast<uint16_t>(a_tile ? 64 : 4 * nb);
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

// pack_vnni's layout (kernels.h), in SIMD, for an ActRef that comes without it. The B tile of tokens
// [j0, j0 + 16) at k-step k is 16 rows of it from vnni + k / 2 * n + j0, row stride 4n bytes.
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
// out[i * n + j] for i < 16 * NB, j < nb. Each B tile is loaded once for the NB blocks. NB = 1: the
// even and odd k-steps accumulate in tmm0 and tmm1 (two chains), summed at the end; NB = 2: block
// b accumulates in tmm<b>. Each k-step also prefetches every row's line `pf` bytes ahead
// (prefetch_bytes(); 0 = off).
template <int NB>
void row_blocks(const uint16_t* w, int64_t K, int64_t ld, const uint32_t* b, int n, int nb, float* out, int64_t pf) {
  alignas(64) uint16_t tail[16 * NB][32];
  _tile_zero(0);
  _tile_zero(1);
  int64_t step = 0;
  const int64_t stop = prefetch_stop(pf, 2 * K, 2 * ld);
  for (int64_t k = 0; k < K; k += 32, ++step) {
    if (pf > 0 && 2 * k < stop) {
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
    const uint32_t* bk = b + k / 2 * n;
    if ((step & 1) == 0) {
      _tile_loadd(4, bk, 4 * n);
      _tile_loadd(2, a0, 2 * stride);
      if constexpr (NB == 2) _tile_loadd(3, a0 + 16 * stride, 2 * stride);
      _tile_dpbf16ps(0, 2, 4);
      if constexpr (NB == 2) _tile_dpbf16ps(1, 3, 4);
    } else {
      _tile_loadd(7, bk, 4 * n);
      _tile_loadd(5, a0, 2 * stride);
      if constexpr (NB == 2) _tile_loadd(6, a0 + 16 * stride, 2 * stride);
      if constexpr (NB == 2) {
        _tile_dpbf16ps(0, 5, 7);
        _tile_dpbf16ps(1, 6, 7);
      } else {
        _tile_dpbf16ps(1, 5, 7);
      }
    }
  }
  alignas(64) float c[32][16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[16], 64);
  for (int i = 0; i < 16 * NB; ++i)
    for (int j = 0; j < nb; ++j) out[i * n + j] = NB == 2 ? c[i][j] : c[i][j] + c[16 + i][j];
}

// int4 weights: 16 rows x nb tokens, one 32-column group per k-step (a group has one scale per
// row, so each step's product gets its own C tile, stored and scaled into fp32 registers:
// acc[row] += scale[row][g] * C_g[row], tokens in lanes). A group's 16 packed bytes expand to an
// A-tile row of 32 exact bf16 values q - 8 with one load, one shift and one table lookup: the bytes
// broadcast to the four 128-bit lanes, word lane 8c + m shifted right by 4c (its nibble c), then
// VPERMW (column order amx_int4_column, which the B tiles at b follow). Groups go in batches of four
// (int4_block below).
// Group g of 16 int4 rows (row stride rb bytes) into the staging A tile dst.
inline __attribute__((always_inline)) void int4_expand(const uint8_t* rows, int64_t rb, int64_t g, __m512i shifts,
                                                      __m512i table, uint16_t (*dst)[32], int64_t pf,
                                                      int64_t stop) {
  if (pf > 0 && (g & 3) == 0 && 16 * g < stop)
    for (int i = 0; i < 16; ++i) _mm_prefetch(reinterpret_cast<const char*>(rows + i * rb + 16 * g) + pf, _MM_HINT_T0);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + i * rb + 16 * g)));
    _mm512_store_si512(dst[i], _mm512_permutexvar_epi16(_mm512_srlv_epi16(v, shifts), table));
  }
}

// int4_block<RP>: the C tile of each group is stored with RP rows (of nb <= 16 / RP tokens each) per
// 64-byte line, so scaling it takes 16 / RP vector loads and FMAs (RP = 2 at 5-8 tokens, 4 at 3-4:
// fewer than one per row); acc[v] holds rows RP v .. RP v + RP - 1, 16 / RP lanes each. A group's
// row scales are one fp32 vector (transposed per block), spread over the lanes by VPERMPS.
template <int RP>
void int4_block(const MatrixRef& w, int64_t r, const uint32_t* b, int n, int nb, float* out, int64_t pf) {
  constexpr int NV = 16 / RP;  // accumulator vectors (RP rows each)
  constexpr int L = 16 / RP;   // lanes per row: the C tile's row stride in fp32
  const int64_t G = w.cols / 32, rb = w.ld / 2, sc_stride = w.ld / 32;
  const uint8_t* rows = w.data + r * rb;
  const uint16_t* sc = w.scales + r * sc_stride;
  const int64_t stop = prefetch_stop(pf, 16 * G, rb);
  alignas(64) uint16_t abuf[2][4][16][32];
  // A C tile of nb columns stores only those (at a row stride of L lanes); the other lanes of cbuf
  // keep what was there, which only ever feeds lanes of acc that are not read. Zeroed once per
  // thread: stack garbage there could be subnormal, and an FMA on a subnormal input costs ~100 cycles.
  alignas(64) thread_local float cbuf[2][4][256] = {};
  thread_local std::vector<float> scales;  // [group][row], fp32, 64-byte aligned rows of 16
  if (scales.size() < static_cast<size_t>(16 * G + 16)) scales.resize(16 * G + 16);
  float* sf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scales.data()) + 63) & ~uintptr_t{63});
  // sf[g * 16 + i] = scale (row i, group g), 16 groups at a time: each row's 16 bf16 scales widen to
  // fp32, then a 16 x 16 transpose (no gathers: with the Gather Data Sampling mitigation that cloud
  // hosts run, a VPGATHERDD costs tens of cycles).
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 m = G - g >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (G - g)) - 1);
    __m512i v[16];
    for (int i = 0; i < 16; ++i)
      v[i] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, sc + i * sc_stride + g)), 16);
    transpose16(v);
    for (int k = 0; k < 16 && g + k < G; ++k) _mm512_store_si512(sf + (g + k) * 16, v[k]);
  }
  const __m512i table = _mm512_load_si512(kInt4Bf16);
  const __m512i shifts = _mm512_set_epi64(0x000C000C000C000C, 0x000C000C000C000C, 0x0008000800080008,
                                          0x0008000800080008, 0x0004000400040004, 0x0004000400040004, 0, 0);
  __m512i lane_row[NV];  // acc[v] lane l belongs to row RP v + l / L
  __m512 acc[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; ++l) idx[l] = RP * v + l / L;
    lane_row[v] = _mm512_load_si512(idx);
    acc[v] = _mm512_setzero_ps();
  }
  // Batches of four groups, software-pipelined over two sets of staging buffers: batch t's four
  // products (C tiles tmm0/1/3/6; A and B tiles alternate between tmm2 / tmm4 and tmm5 / tmm7, so a
  // load overlaps the previous product) are issued first, then the vector work that does not wait
  // for them (expanding batch t + 1, scaling batch t - 1 from its stored C tiles), then batch t's
  // C tiles are stored. In program order the expansion, products, stores and scaling of a batch wait
  // on each other (a tile load reads only committed stores; a vector load, only stored tiles).
  const auto expand = [&](int64_t t) {
    const int64_t g0 = 4 * t;
    const int nq = static_cast<int>(std::min<int64_t>(4, G - g0));
    for (int q = 0; q < nq; ++q) int4_expand(rows, rb, g0 + q, shifts, table, abuf[t & 1][q], pf, stop);
  };
  const auto scale = [&](int64_t t) {
    const int64_t g0 = 4 * t;
    const int nq = static_cast<int>(std::min<int64_t>(4, G - g0));
    const float(*cb)[256] = cbuf[t & 1];
    for (int q = 0; q < nq; ++q) {
      const __m512 s = _mm512_load_ps(sf + (g0 + q) * 16);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v)
        acc[v] = _mm512_fmadd_ps(_mm512_load_ps(cb[q] + 16 * v), _mm512_permutexvar_ps(lane_row[v], s), acc[v]);
    }
  };
  const int64_t batches = (G + 3) / 4;
  expand(0);
  for (int64_t t = 0; t < batches; ++t) {
    publish(abuf);
    const int nq = static_cast<int>(std::min<int64_t>(4, G - 4 * t));
    const uint32_t* bk = b + 4 * t * 16 * n;
    uint16_t(*ab)[16][32] = abuf[t & 1];
    // group 4 t + q: C tile c, A tile a, B tile bt (tile numbers are immediates)
#define FTJAX_INT4_PRODUCT(q, c, a, bt)              \
  if (nq > q) {                                      \
    _tile_zero(c);                                   \
    _tile_loadd(a, ab[q], 64);                       \
    _tile_loadd(bt, bk + q * 16 * n, 4 * n);         \
    _tile_dpbf16ps(c, a, bt);                        \
  }
    FTJAX_INT4_PRODUCT(0, 0, 2, 4)
    FTJAX_INT4_PRODUCT(1, 1, 5, 7)
    FTJAX_INT4_PRODUCT(2, 3, 2, 4)
    FTJAX_INT4_PRODUCT(3, 6, 5, 7)
#undef FTJAX_INT4_PRODUCT
    if (t + 1 < batches) expand(t + 1);
    if (t > 0) scale(t - 1);
    float(*cb)[256] = cbuf[t & 1];
    _tile_stored(0, cb[0], 4 * L);
    if (nq > 1) _tile_stored(1, cb[1], 4 * L);
    if (nq > 2) _tile_stored(3, cb[2], 4 * L);
    if (nq > 3) _tile_stored(6, cb[3], 4 * L);
    publish(cbuf);
  }
  scale(batches - 1);
  alignas(64) float res[256];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) _mm512_store_ps(res + 16 * v, acc[v]);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < nb; ++j) out[i * n + j] = res[i * L + j];
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
  const AmxRoute route = amx_route(w.format, a.n, a.bf16 != nullptr, a.vnni != nullptr, K, r1 - r0);
  count_amx_route(route);
  if (route == AmxRoute::kAvx512) return dot_rows_avx512bf16(w, r0, r1, a, out);
  if (route == AmxRoute::kInt4) {
    const int64_t pf = prefetch_bytes();
    for (int j0 = 0; j0 < a.n; j0 += 16) {
      const int nb = std::min(16, a.n - j0);
      configure(nb, true);
      const auto block = nb <= 4 ? int4_block<4> : nb <= 8 ? int4_block<2> : int4_block<1>;
      for (int64_t r = r0; r < r_amx; r += 16) block(w, r, a.vnni + j0, a.n, nb, out + (r - r0) * a.n + j0, pf);
    }
    if (r_amx < r1) dot_rows_avx512bf16(w, r_amx, r1, a, out + (r_amx - r0) * a.n);
    return;
  }
  const uint32_t* b = a.vnni != nullptr ? a.vnni : repack(a, K);
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
