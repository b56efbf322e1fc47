// CPU expert kernel primitive: out[r][j] = dot(W[r, :], a_j) for a block of weight rows and a few
// activation vectors, with W in f32, bf16 or int4 (group 32, bf16 scales, dequantised in the loop).
// One implementation per ISA tier (kernels_<tier>.cc, each compiled with its own target flags),
// chosen at run time from CPUID; the MoE driver (moe.cc) is ISA-independent.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "pool.h"

namespace ftjax {

enum class Tier : int { kScalar = 0, kAvx2 = 1, kAvx512Bf16 = 2, kAmx = 3 };  // best last
// The tiers that read the q15 layout (and its q8 form): AVX2 emulates VPDPBUSD (VPMADDUBSW + VPMADDWD); the pair64
// order: the AVX-512 tiers only.
inline bool reads_q15(Tier t) { return t >= Tier::kAvx2; }
inline bool reads_pair64(Tier t) { return t >= Tier::kAvx512Bf16; }

// One expert's [rows, cols] matrix inside a bank row, or a window of its columns (column_window).
struct MatrixRef {
  WeightFormat format;
  int64_t rows, cols;
  const uint8_t* data;  // f32/bf16: row r at data + r * ld elements; int4: packed nibbles, ld / 2 bytes a row
  const uint16_t* scales;  // int4 only: bf16, ld / 32 a row
  int64_t ld;              // row stride in elements: cols for a whole matrix, more for a column window
};
MatrixRef matrix_of(const Bank& bank, int64_t expert);
// Columns [c0, c0 + n) of w (every row): the same memory, ld unchanged. int4: c0 and n multiples of 32.
MatrixRef column_window(const MatrixRef& w, int64_t c0, int64_t n);

// The packed nibbles and the bf16 scales of int4 rows r .. r + R - 1.
template <int R>
inline void int4_rows(const MatrixRef& w, int64_t r, const uint8_t* (&row)[R], const uint16_t* (&sc)[R]) {
  for (int i = 0; i < R; ++i) {
    row[i] = w.data + (r + i) * (w.ld / 2);
    sc[i] = w.scales + (r + i) * (w.ld / 32);
  }
}

// n activation vectors of length cols, each in f32 and, when the call runs in bf16 activations, also as bf16 bits
// (the same values) for the tiers that multiply in bf16.
struct ActRef {
  const float* f32;  // nullptr only with q15 (int4 rows leave no tail; the q15 loop reads no f32)
  const uint16_t* bf16;  // nullptr: f32 activations
  int64_t stride;        // elements between vectors
  int n;
  // Optional (int4 weights, bf16 activations, cols % 64 == 0): the bf16 vectors again in the
  // pair64 order (pair64_index), which lets the AVX-512 tier turn two int4 groups into bf16 with
  // one byte widening and two table permutes. nullptr: not provided (the tiers use bf16).
  const uint16_t* bf16_pair64 = nullptr;
  // Optional (bf16 activations, AMX tier): the vectors already in the B-tile pair layout of
  // pack_vnni, built once per call instead of once per block of weight rows, in the weights'
  // column order (int4_order for int4 weights). nullptr: bf16 weights get them packed by the tier,
  // int4 weights go to the AVX-512 tier.
  const uint32_t* vnni = nullptr;
  // Optional (int4 weights, bf16 activations, AVX-512 tiers): the vectors in the q15 layout (below), vector j
  // at q15 + j * kQ15Streams * q15_stream, each stream q15_stream bytes; a column window's ActRef points
  // c0 / 2 bytes in. nullptr: not provided (the tiers use bf16_pair64 or bf16).
  const int8_t* q15 = nullptr;
  int64_t q15_stream = 0;
  // The q15 pointer holds the q8 form of the layout (below): int8 activations, not exact.
  bool q8 = false;
};

// The q15 layout of a bf16 vector of length K (K % 8 == 0) for the int4 VNNI loop (VPDPBUSD: unsigned
// nibbles times signed bytes). Each lane of 8 columns (k = 8d .. 8d + 7, the columns of packed bytes 4d ..
// 4d + 3 of an int4 row) has a power-of-two scale 2^-s, s chosen from the lane's largest exponent so that
// q = round(x * 2^s) fits [-16384, 16383]; q = 128 * hi + lo, hi in [-128, 127], lo in [0, 127]. Exact for
// every element within 2^6 of the lane's largest; the others round by at most 2^-14 of the lane's largest
// (bf16 itself keeps 2^-9: the products differ from exact bf16 ones far below the activations' own rounding).
// Six streams of K / 2 bytes each, column k's entries at byte k / 2 of the first four, its lane's at byte
// 4 * (k / 8) of the last two (so a column window's entries all sit c0 / 2 bytes in):
//   0: hi of the even columns, 1: hi of the odd columns, 2: lo of the even, 3: lo of the odd (int8 each);
//   4: -8 * (sum of the lane's q) as int32 (the nibbles' offset of 8, taken out once per lane);
//   5: 2^-s as f32 (NaN when the lane holds an inf or NaN).
constexpr int kQ15Streams = 6;
inline int64_t q15_bytes(int64_t K) { return kQ15Streams * (K / 2); }
// Writes columns [k0, k1) (multiples of 8) of x's layout at base (stream bytes S = K / 2). In AVX-512 where the CPU
// runs it, else in AVX2 (the same bytes).
void to_q15(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S);
// The q8 form of the layout (int4_act_bits() == 8, opt-in, lossy): per lane of 8 columns a scale m / 127 (m the lane's
// largest magnitude; lanes with m < 2^-100 are zeros) and q = round(x * (127 / m)) in [-127, 127] (f32 products,
// nearest even), one VPDPBUSD per token and nibble half instead of two. Streams 0 and 1 hold q of the even and the
// odd columns, 4 and 5 as above (-8 * sum q, the scale; NaN for a lane with an inf or NaN); 2 and 3 are not written.
// Each element off by at most m / 254 (bf16 keeps |x| 2^-9).
void to_q8(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S);
// 15 (default: the exact q15 layout) or 8 (the q8 form) for the int4 x bf16 calls that take the VNNI loop.
int int4_act_bits();
void set_int4_act_bits(int bits);
// With the q8 form, up to how many tokens per expert int4 x bf16 calls take the VNNI loop (instead of
// int4_vnni_tokens); more: as above (the AMX int4 tiles or the bf16 products). Default kInt4Q8Tokens (H200 host, Xeon,
// 15 threads, exactly N tokens per expert, bench/RESULTS.md session 30: at 8 the q8 loop 0.23 / 0.34 of STREAM against
// the AMX int4 tiles' 0.20 / 0.31 (Qwen3.6 / large), at 16 0.12 / 0.18 against 0.13 / 0.24; dev box, Zen 4, one core:
// 8 tokens 1.0-1.3x the bf16 loop); where AVX2 is the best tier kInt4VnniTokensAvx2 (every count: the q8 loop led the
// q15 one at 1-32 tokens per expert on the dev box of session 45, 1.1-1.5x).
constexpr int64_t kInt4Q8Tokens = 8;
int64_t int4_q8_tokens();
void set_int4_q8_tokens(int64_t tokens);  // 0 .. 64
// The VNNI loop's limit in the current mode: int4_q8_tokens() with the q8 form, else int4_vnni_tokens().
int64_t int4_vnni_limit();
// Up to how many tokens per expert int4 x bf16 calls use the q15 layout and VPDPBUSD (AVX2 and AVX-512 loops; on the AMX
// tier such groups skip its int4 tiles too); more: the pair64 order and VDPBF16PS (the loop before) or the AMX int4
// tiles; 0: never. Default: kInt4VnniTokensAmx where the AMX tier runs (H200 host, Xeon, 15 threads, round robin,
// bench/RESULTS.md session 28: 1.09-1.24x the bf16 loop at 1-8 tokens; session 29, exactly N tokens per expert: the
// q15 loop ahead of the AMX int4 tiles at 4 (0.41 / 0.59 of STREAM against 0.33 / 0.49, Qwen3.6 / large) and 5
// (0.29 / 0.32 against 0.27 / 0.33), level at 6 (0.24 / 0.29-0.30 against 0.25 / 0.33), behind from 7 (8: 0.17 / 0.23
// against 0.20-0.21 / 0.32); from 16 the tiles 1.5-1.9x ahead); kInt4VnniTokens elsewhere with AVX-512 (dev box, Zen 4, one
// core: 1 token 1.11-1.34x faster, 4-8 tokens 0.75-0.87x); kInt4VnniTokensAvx2 (every count) where AVX2 is the best tier:
// there the other loop dequantizes to f32 (dev box of session 45, AMD EPYC without AVX-512, one thread, from DRAM, round
// robin: the q15 loop 1.8-2.1x at 1 token, 1.6-1.7x at 4 per expert, 1.4x at 8, 1.35x at 16, 1.3x at 32).
constexpr int64_t kInt4VnniTokens = 2, kInt4VnniTokensAmx = 5, kInt4VnniTokensAvx2 = 64;
int64_t int4_vnni_tokens();
void set_int4_vnni_tokens(int64_t tokens);  // 0 .. 64

// The AMX B-tile layout of n bf16 vectors of length K: dst[p * n + j] = the pair (x_j[c(2p)],
// x_j[c(2p + 1)]) as one dword (low word first), for p < vnni_pairs(K), zero past K (so a last
// partial 32-column step adds exact zeros). c(pos) = pos, or with int4_order, amx_int4_column(pos):
// the AMX tier expands a 16-byte int4 group (byte b: columns 2b, 2b + 1) into an A-tile row from four
// copies of it, word lane 8c + m of copy c keeping nibble c of the word (bytes 2m, 2m + 1), i.e.
// column 4m + c. pack_vnni below writes vector x_j's share (the vectors of a call pack in parallel).
inline int64_t vnni_pairs(int64_t K) { return (K + 31) / 32 * 16; }
// The AMX tier takes an expert's rows from this many tokens on (fewer: its AVX-512 loops, faster there:
// they do not pay for the unused tile columns; dev-box Xeon, one core: bf16 27 vs 20 GB/s at 1 token,
// int4 12.6 vs 8.3), so only such groups need their activations packed.
constexpr int kAmxMinTokens = 3;
inline int64_t amx_int4_column(int64_t pos) {
  const int64_t e = pos & 31;
  return (pos - e) + 4 * (e & 7) + (e >> 3);
}
inline int64_t amx_int4_position(int64_t k) {  // the inverse
  const int64_t e = k & 31;
  return (k - e) + 8 * (e & 3) + (e >> 2);
}
// Columns [k0, k1) only (multiples of 32; k1 may pass K: the pad pairs are written as zeros). In
// AVX-512 (only the AMX tier reads the layout).
void pack_vnni(const uint16_t* xj, int64_t K, int64_t k0, int64_t k1, int n, int j, uint32_t* dst, bool int4_order);
// Which loops the AMX tier runs for a call (the rest of a call's rows past the last block of 16
// go to the AVX-512 loops in every case): the tile path for bf16 weights (activations packed by the
// tier unless given), the int4 tile path (only with the activations given in the B layout), or all
// of it on AVX-512 (fewer than kAmxMinTokens tokens, f32 weights or activations, K < 32, < 16 rows).
enum class AmxRoute : int { kAvx512 = 0, kBf16 = 1, kInt4 = 2 };
AmxRoute amx_route(WeightFormat format, int n_tokens, bool bf16_act, bool vnni_given, int64_t K, int64_t rows);
// How many dot_rows calls the AMX tier routed each way, since the process started (per-thread
// counters, summed when read): tests and benchmarks check which loops really ran.
void count_amx_route(AmxRoute r);
std::vector<int64_t> amx_route_counts();  // indexed by AmxRoute

// Position of element k of a vector in the pair64 order: in each span of 64 elements, e = k % 64
// goes to (e & 1) * 32 + (e >> 2) * 2 + ((e >> 1) & 1). A span of packed int4 weights is 32 bytes,
// byte b holding elements 2b (low nibble) and 2b + 1; widened to words, the low nibbles give
// elements 0, 2, 4, ... and the high nibbles 1, 3, 5, ...; VDPBF16PS multiplies word pairs (2l,
// 2l + 1), i.e. elements (4l, 4l + 2) and (4l + 1, 4l + 3): the activations are laid out to match.
inline int64_t pair64_index(int64_t k) {
  const int64_t e = k & 63;
  return (k - e) + (e & 1) * 32 + (e >> 2) * 2 + ((e >> 1) & 1);
}
// dst[pair64_index(k)] = x[k] for k < K, K % 64 == 0, in AVX-512 (only those tiers read the order).
void to_pair64(const uint16_t* x, int64_t K, uint16_t* dst);

// bf16 bits of q - 8 for a nibble q (exact in bf16), twice: VPERMW reads 5 index bits, so an index
// whose bit 4 comes from the next nibble still finds the value of its low 4 bits (AVX-512 and AMX tiers).
alignas(64) inline constexpr uint16_t kInt4Bf16[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000,
    0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
    0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

// out[(r - r0) * a.n + j] = sum_k W[r, k] * a_j[k], for r in [r0, r1).
using DotRowsFn = void (*)(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out);

// out[r - r0] = sum_m wts[m] * (W_m[r, :] . a_m) for r in [r0, r1): n matrices (an expert's rows each, column
// windows allowed), each with one activation vector (as[m].n == 1). AVX-512 tiers only: the MoE driver sums a
// token's lone experts' down rows with it (down_sum), instead of one dot_rows call, reduction and store per expert.
void dot_rows_sum(const MatrixRef* ws, const ActRef* as, const float* wts, int n, int64_t r0, int64_t r1, float* out);

// out[j][h] += sum over i in [i0, i1) of c[j][i] * W[i, h], for h in [h0, h1) and j < n: rows of an f32 or bf16 matrix
// scaled and summed into n vectors (c[j] and out[j] are indexed by the absolute row and column). The MoE driver's
// down pass over a transposed down bank (DownLayout::kIH: row i is unit i's down column): a unit window [u, I) is
// whole rows, read one after another. The out[j] must not overlap (the SIMD tiers keep each in registers while they
// add a step of rows). Every tier; the AMX tier runs the AVX-512 loop (no tile form).
using AxpyRowsFn = void (*)(const MatrixRef& w, int64_t i0, int64_t i1, const float* const* c, int n, int64_t h0,
                            int64_t h1, float* const* out);
AxpyRowsFn axpy_rows_for(Tier t);
void axpy_rows_scalar(const MatrixRef&, int64_t, int64_t, const float* const*, int, int64_t, int64_t, float* const*);
void axpy_rows_avx2(const MatrixRef&, int64_t, int64_t, const float* const*, int, int64_t, int64_t, float* const*);
void axpy_rows_avx512(const MatrixRef&, int64_t, int64_t, const float* const*, int, int64_t, int64_t, float* const*);

const char* tier_name(Tier t);
std::vector<Tier> available_tiers();  // compiled in and supported by this CPU, best last
Tier active_tier();
void set_tier(const std::string& name);  // "auto" | "scalar" | "avx2" | "avx512bf16" | "amx"
DotRowsFn dot_rows_for(Tier t);
// How far ahead (bytes) the AVX-512 and AMX tiers prefetch each weight row; 0 turns it off. Default
// kDefaultPrefetchBytes; benchmarks sweep it (bench/host_runtime.py --prefetch).
constexpr int64_t kDefaultPrefetchBytes = 512;
int64_t prefetch_bytes();
void set_prefetch_bytes(int64_t bytes);  // 0 .. 1 MiB
// Rows of at most short_row_bytes() prefetch a whole tile of rows ahead instead (the same column R rows
// further, an AVX-512 micro-tile, inside the call's rows): a row's prefetch pf bytes ahead would land in
// the next row, which the tile reads already (Qwen3.6 down rows are 1 KiB in bf16, int4 rows 256 B - 1 KiB;
// H200 host, bench/RESULTS.md session 15 call 13: Qwen bf16 1x8 0.78 -> 0.85 of STREAM, large int4 1x8
// 0.54 -> 0.68). A call's first tile is prefetched up front (dot_rows_avx512bf16: the lines of its rows' columns).
// Default kShortRowBytes; 0 turns it off (bench/host_runtime.py --short-rows compares).
constexpr int64_t kShortRowBytes = 2048;
int64_t short_row_bytes();
void set_short_row_bytes(int64_t bytes);  // 0 .. 1 MiB
// The prefetch distance of a tile of `rows` rows of `row_bytes` (row stride) each, whose call goes on
// past the next tile (`next_in_call`; past the call's rows, another thread may be reading them: in
// 8-token calls that prefetch cost 0.05 of STREAM).
inline int64_t prefetch_distance(int64_t rows, int64_t row_bytes, bool next_in_call) {
  const int64_t pf = prefetch_bytes();
  return pf > 0 && next_in_call && row_bytes <= short_row_bytes() ? rows * row_bytes : pf;
}
// The byte offset into a row's read columns (`window` bytes of a `row_bytes` stride) from which a
// prefetch `pf` bytes ahead is skipped: window - pf when the call reads a column window (the unit
// split's down [u, I)), since past the window's end lie the gap before the next row's window, lines
// nobody reads (at u = 192 of a Qwen3.6 down, 6 of every 16). Whole rows and a tile ahead
// (pf >= row_bytes: the same columns of later rows) are not limited.
// window_prefetch(false) turns the limit off (the earlier kernels, for benchmarks: bench/unit_windows.py).
bool window_prefetch();
void set_window_prefetch(bool on);
inline int64_t prefetch_stop(int64_t pf, int64_t window, int64_t row_bytes) {
  return window < row_bytes && pf < row_bytes && window_prefetch() ? window - pf : INT64_MAX;
}
// Long rows (pf < row_bytes) whose tile has another after it in the call: in the last pf bytes of each row's
// window, prefetch the next tile's row instead (the same distance, shifted by R rows and back by the window),
// so the next tile does not start on cold lines (a tile's 4 rows are 4 new pages, where the hardware's stream
// prefetchers start over). tile_prefetch(false): as before (past the window's end: nothing for a column window,
// the next row for whole rows).
bool tile_prefetch();
void set_tile_prefetch(bool on);
// A tile's row prefetch: `pf` bytes ahead of the loads; from byte offset `stop` of the read columns on, either
// none (jump == kNone) or `jump` bytes further (into the next tile's rows, up to their window's end).
struct RowPrefetch {
  static constexpr int64_t kNone = INT64_MIN;
  int64_t pf, stop, jump, window;
  // how far past the load at byte offset `at` of its row to prefetch; kNone: nothing
  int64_t ahead(int64_t at) const {
    if (at < stop) return pf;
    return jump == kNone || at + pf - window >= window ? kNone : pf + jump;
  }
};
inline RowPrefetch row_prefetch(int64_t rows, int64_t window, int64_t row_bytes, bool next_in_call) {
  const int64_t pf = prefetch_distance(rows, row_bytes, next_in_call);
  if (pf <= 0 || pf >= row_bytes) return {pf, INT64_MAX, 0, window};  // off, or a tile ahead (short rows)
  if (next_in_call && tile_prefetch()) return {pf, window - pf, rows * row_bytes - window, window};
  return {pf, prefetch_stop(pf, window, row_bytes), RowPrefetch::kNone, window};
}

// Per-tier entry points (defined only where compiled; see CMakeLists.txt).
void dot_rows_scalar(const MatrixRef&, int64_t, int64_t, const ActRef&, float*);
void dot_rows_avx2(const MatrixRef&, int64_t, int64_t, const ActRef&, float*);
void to_q15_avx2(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S);
void to_q8_avx2(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S);
void dot_rows_avx512bf16(const MatrixRef&, int64_t, int64_t, const ActRef&, float*);
void dot_rows_amx(const MatrixRef&, int64_t, int64_t, const ActRef&, float*);
void dot_rows_sum_avx512bf16(const MatrixRef* ws, const ActRef* as, const float* wts, int n, int64_t r0, int64_t r1,
                             float* out);
void pack_vnni_avx512(const uint16_t* xj, int64_t K, int64_t k0, int64_t k1, int n, int j, uint32_t* dst,
                      bool int4_order);
void to_pair64_avx512(const uint16_t* x, int64_t K, uint16_t* dst);
void to_q15_avx512(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S);
void to_q8_avx512(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S);
bool amx_enable();  // asks the kernel for AMX tile state; false if refused

inline float bf16_to_f32(uint16_t b) {
  union { uint32_t u; float f; } v{static_cast<uint32_t>(b) << 16};
  return v.f;
}
// Weight (row, k) of an f32 or bf16 matrix: the SIMD tiers' scalar tail for widths that are not a
// multiple of their vector length.
inline float dense_weight(const MatrixRef& w, int64_t row, int64_t k) {
  return w.format == WeightFormat::kF32 ? reinterpret_cast<const float*>(w.data)[row * w.ld + k]
                                        : bf16_to_f32(reinterpret_cast<const uint16_t*>(w.data)[row * w.ld + k]);
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN kept quiet)
  union { float f; uint32_t u; } v{f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((v.u >> 16) | 0x40);
  return static_cast<uint16_t>((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

}  // namespace ftjax
