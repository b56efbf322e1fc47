// A probe, not the runtime: would an int4 layout with the output rows in SIMD lanes let the CPU expert call
// read Qwen3.6-shaped int4 experts at >= 0.8 of STREAM (issue 3's goal, missed by the row-major layout)?
//
//   g++ -O2 -march=native -pthread -o /tmp/int4_repack bench/int4_repack.cc && /tmp/int4_repack
//   g++ -O2 -DINT4_EMULATE -pthread -o /tmp/int4_repack bench/int4_repack.cc   (no AVX-512: the same code on
//   scalar stand-ins for the vector operations; for checking the layout and the arithmetic, not for timing)
//
// The row-major layout (ftjax/host/quant.py) keeps a matrix [out, in] as packed nibbles [out, in/2] and then
// bf16 scales [out, in/32]: each output row is a dot product reduced across lanes at its end, and the Qwen
// shape's down rows are 256 B of nibbles plus 32 B of scales in a second stream (session 30's loads-only probe:
// the call's reads alone stop at 0.73-0.82 of STREAM there). The layout here ("r16"): blocks of 16 output rows;
// per block, per group of 32 inputs, one 288-byte tile: four 64-byte vectors, vector v's dword lane j holding
// row j's inputs 8v..8v+3 in its bytes' low nibbles and 8v+4..8v+7 in their high nibbles, then the 16 rows'
// bf16 scales. A block is one contiguous stream; the 16 rows' sums stay in the lanes (no reduction), and
// VPDPBUSD multiplies the nibbles (u8, 0..15) by int8 activations broadcast from memory: per group, per token,
// 8 VPDPBUSD and one scaling (value = (q - 8) * scale: the -8 enters as -8 * sum(q_x) in the accumulator).
// Activations: int8 per group of 32 with scale max|x| / 127 (the q8 form of the runtime's opt-in
// int4_act_bits=8, here per group, not per 8 columns: lossier; the probe reports the error).
//
// A call: 1 or more tokens, each routed to some experts of a fresh stretch of a pool larger than the caches;
// round 1: items of 32 intermediate rows of one expert (gate and up blocks, SwiGLU, and the group's
// int8 quantization of h); round 2: items of 16 output rows over every expert of the call (y += w * down . h).
// Threads: persistent, pinned, spinning between rounds (as the runtime's pool beside a GPU). Ceiling: a
// STREAM-like read of the same window by the same threads, in the same run. Prints a table; every case is
// checked against a double-precision reference of the same quantized arithmetic, and its error against the
// unquantized product is reported.
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifndef INT4_EMULATE
#include <immintrin.h>
#endif

#include "probe_team.h"

namespace {

constexpr int kGroup = 32, kRows = 16, kTile = 4 * 64 + 2 * kRows;  // 288 bytes: 16 rows x 32 inputs + scales

// ---- vector operations: AVX-512 (F, BW, VNNI) or scalar stand-ins with the same semantics ----
#ifdef INT4_EMULATE
struct V {
  union {
    uint8_t u8[64];
    int8_t i8[64];
    uint16_t u16[32];
    int32_t i32[16];
    float f[16];
  };
};
inline V load_v(const void* p) { V v; std::memcpy(v.u8, p, 64); return v; }
inline V low_nibbles(V w) { for (auto& b : w.u8) b &= 0x0F; return w; }
inline V high_nibbles(V w) {  // VPSRLW by 4, then the bytes' low nibbles
  for (int i = 0; i < 32; ++i) w.u16[i] = static_cast<uint16_t>(w.u16[i] >> 4);
  return low_nibbles(w);
}
inline V bcast_i32(const void* p) { V v; int32_t x; std::memcpy(&x, p, 4); for (auto& e : v.i32) e = x; return v; }
inline V set_i32(int32_t x) { V v; for (auto& e : v.i32) e = x; return v; }
inline V dpbusd(V acc, V a, V b) {
  for (int j = 0; j < 16; ++j) {
    int32_t s = 0;
    for (int c = 0; c < 4; ++c) s += static_cast<int32_t>(a.u8[4 * j + c]) * static_cast<int32_t>(b.i8[4 * j + c]);
    acc.i32[j] = static_cast<int32_t>(static_cast<uint32_t>(acc.i32[j]) + static_cast<uint32_t>(s));
  }
  return acc;
}
inline V add_i32(V a, V b) { for (int j = 0; j < 16; ++j) a.i32[j] += b.i32[j]; return a; }
inline V shl7_i32(V a) { for (auto& e : a.i32) e = static_cast<int32_t>(static_cast<uint32_t>(e) << 7); return a; }
inline V zero_ps() { V v; for (auto& e : v.f) e = 0.f; return v; }
inline V set_ps(float x) { V v; for (auto& e : v.f) e = x; return v; }
inline V cvt_ps(V a) { V v; for (int j = 0; j < 16; ++j) v.f[j] = static_cast<float>(a.i32[j]); return v; }
inline V mul_ps(V a, V b) { for (int j = 0; j < 16; ++j) a.f[j] *= b.f[j]; return a; }
inline V fmadd_ps(V a, V b, V c) { for (int j = 0; j < 16; ++j) c.f[j] = std::fma(a.f[j], b.f[j], c.f[j]); return c; }
inline V bf16_ps(const uint16_t* p) {
  V v;
  for (int j = 0; j < 16; ++j) {
    const uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
    std::memcpy(&v.f[j], &bits, 4);
  }
  return v;
}
inline void store_ps(float* p, V v) { std::memcpy(p, v.f, 64); }
inline void prefetch(const void*) {}
inline uint64_t stream_chunk(const uint8_t* p, size_t n) {
  uint64_t s = 0, x;
  for (size_t i = 0; i < n; i += 64) { std::memcpy(&x, p + i, 8); s ^= x; }
  return s;
}
inline uint64_t stream_chunk32(const uint8_t* p, size_t n) { return stream_chunk(p, n); }
#else
using V = __m512i;
inline V load_v(const void* p) { return _mm512_loadu_si512(p); }
inline V low_nibbles(V w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
inline V high_nibbles(V w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
inline V bcast_i32(const void* p) { int32_t x; std::memcpy(&x, p, 4); return _mm512_set1_epi32(x); }
inline V set_i32(int32_t x) { return _mm512_set1_epi32(x); }
inline V dpbusd(V acc, V a, V b) { return _mm512_dpbusd_epi32(acc, a, b); }
inline V add_i32(V a, V b) { return _mm512_add_epi32(a, b); }
inline V shl7_i32(V a) { return _mm512_slli_epi32(a, 7); }
inline V zero_ps() { return _mm512_castps_si512(_mm512_setzero_ps()); }
inline V set_ps(float x) { return _mm512_castps_si512(_mm512_set1_ps(x)); }
inline V cvt_ps(V a) { return _mm512_castps_si512(_mm512_cvtepi32_ps(a)); }
inline V mul_ps(V a, V b) { return _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b))); }
inline V fmadd_ps(V a, V b, V c) {
  return _mm512_castps_si512(
      _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), _mm512_castsi512_ps(c)));
}
inline V bf16_ps(const uint16_t* p) {
  return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}
inline void store_ps(float* p, V v) { _mm512_storeu_ps(p, _mm512_castsi512_ps(v)); }
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline uint64_t stream_chunk(const uint8_t* p, size_t n) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 256) {
    a = _mm512_xor_si512(a, _mm512_load_si512(p + i));
    b = _mm512_xor_si512(b, _mm512_load_si512(p + i + 64));
    c = _mm512_xor_si512(c, _mm512_load_si512(p + i + 128));
    d = _mm512_xor_si512(d, _mm512_load_si512(p + i + 192));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3] ^ lanes[4] ^ lanes[5] ^ lanes[6] ^ lanes[7];
}
// The runtime's read (cpp/stream.cc): four chains of 32-byte loads.
inline uint64_t stream_chunk32(const uint8_t* p, size_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 128) {
    a = _mm256_xor_si256(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_xor_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_xor_si256(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_xor_si256(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d)));
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}
#endif

using probe::now;
using probe::Team;

// ---- the layout ----
struct Shape {
  const char* name;
  int H, I;  // hidden, expert intermediate
  int64_t tiles_gu() const { return int64_t(2) * I / kRows * (H / kGroup); }  // gate and up
  int64_t tiles_down() const { return int64_t(H) / kRows * (I / kGroup); }
  int64_t expert_bytes() const { return (tiles_gu() + tiles_down()) * kTile; }
};
// Expert: the gate/up region, item by item (32 intermediate rows: gate block 2i, up block 2i, gate block 2i+1,
// up block 2i+1, each H/32 tiles), then the down region (H/16 blocks of I/32 tiles).
inline const uint8_t* gu_block(const uint8_t* e, const Shape& s, int64_t blk, int up) {
  return e + ((blk * 2 + up) * (s.H / kGroup)) * int64_t(kTile);
}
inline const uint8_t* down_block(const uint8_t* e, const Shape& s, int64_t blk) {
  return e + (s.tiles_gu() + blk * (s.I / kGroup)) * int64_t(kTile);
}

// An activation vector in integers per group of 32, with the group's scale and -8 * sum(q) (the nibbles'
// offset). 8 bits: q in int8 (|q| <= 127, scale max|x| / 127). 15 bits: q = 128 q + ql with q in int8 and
// ql in 0..127 (|value| <= 16383, scale max|x| / 16383): two VPDPBUSD chains, near exact as the runtime's q15.
struct QAct {
  std::vector<int8_t> q, ql;
  std::vector<float> scale;
  std::vector<int32_t> neg8sum;
  explicit QAct(int n = 0) : q(n), ql(n), scale(n / kGroup), neg8sum(n / kGroup) {}
  int32_t value(int k, int bits) const { return bits == 15 ? 128 * q[k] + ql[k] : q[k]; }
};
void quantize_group(const float* x, int bits, QAct& a, int k0) {
  const int top = bits == 15 ? 16383 : 127;
  float m = 0.f;
  for (int k = 0; k < kGroup; ++k) m = std::max(m, std::fabs(x[k]));
  const float inv = m > 0.f ? top / m : 0.f;
  int32_t sum = 0;
  for (int k = 0; k < kGroup; ++k) {
    const int v = std::max(-top, std::min(top, static_cast<int>(std::nearbyint(x[k] * inv))));
    if (bits == 15) {
      a.q[k0 + k] = static_cast<int8_t>(v >> 7);  // floor: v = 128 (v >> 7) + (v & 127)
      a.ql[k0 + k] = static_cast<int8_t>(v & 127);
    } else {
      a.q[k0 + k] = static_cast<int8_t>(v);
    }
    sum += v;
  }
  a.scale[k0 / kGroup] = m > 0.f ? m / top : 0.f;
  a.neg8sum[k0 / kGroup] = -8 * sum;
}

// out[t][0..15] = the 16 rows of block `blk` (n_groups tiles) dotted with activation t, for T tokens. Software
// prefetch `pf` bytes ahead; past the block's end into `next` (the block this thread reads next; null: none).
// Bits 0: the loads alone (no products; out is a checksum): the layout's own read rate.
template <int T, int Bits>
inline __attribute__((always_inline)) void block_dot(const uint8_t* blk, int n_groups, const uint8_t* next,
                                                     const QAct* const* a, int pf, float (*out)[kRows]) {
  const uint8_t* end = blk + int64_t(n_groups) * kTile;
  V f[T];
  for (int t = 0; t < T; ++t) f[t] = zero_ps();
  for (int g = 0; g < n_groups; ++g) {
    const uint8_t* tile = blk + int64_t(g) * kTile;
    if (pf)
      for (int l = 0; l < kTile; l += 64) {
        const uint8_t* p = tile + pf + l;
        if (p >= end) {
          if (!next) break;
          p = next + (p - end);
        }
        prefetch(p);
      }
    if (Bits == 0) {
      V sum = load_v(tile);
      for (int v = 1; v < 4; ++v) sum = add_i32(sum, load_v(tile + 64 * v));
      f[0] = add_i32(f[0], add_i32(sum, bf16_ps(reinterpret_cast<const uint16_t*>(tile + 256))));
      continue;
    }
    // 8 bits: two chains per token (the nibbles' low and high halves); 15 bits: two chains (q and ql), both halves
    V acc0[T], acc1[T];
    for (int t = 0; t < T; ++t) acc0[t] = set_i32(Bits == 15 ? 0 : a[t]->neg8sum[g]), acc1[t] = set_i32(Bits == 15 ? a[t]->neg8sum[g] : 0);
    for (int v = 0; v < 4; ++v) {
      const V w = load_v(tile + 64 * v), lo = low_nibbles(w), hi = high_nibbles(w);
      for (int t = 0; t < T; ++t) {
        const int8_t* q = a[t]->q.data() + g * kGroup + 8 * v;
        if (Bits == 15) {
          const int8_t* ql = a[t]->ql.data() + g * kGroup + 8 * v;
          acc0[t] = dpbusd(dpbusd(acc0[t], lo, bcast_i32(q)), hi, bcast_i32(q + 4));
          acc1[t] = dpbusd(dpbusd(acc1[t], lo, bcast_i32(ql)), hi, bcast_i32(ql + 4));
        } else {
          acc0[t] = dpbusd(acc0[t], lo, bcast_i32(q));
          acc1[t] = dpbusd(acc1[t], hi, bcast_i32(q + 4));
        }
      }
    }
    const V ws = bf16_ps(reinterpret_cast<const uint16_t*>(tile + 256));
    for (int t = 0; t < T; ++t) {
      const V sum = Bits == 15 ? add_i32(shl7_i32(acc0[t]), acc1[t]) : add_i32(acc0[t], acc1[t]);
      f[t] = fmadd_ps(cvt_ps(sum), mul_ps(ws, set_ps(a[t]->scale[g])), f[t]);
    }
  }
  for (int t = 0; t < T; ++t) store_ps(out[t], f[t]);
}

template <class F>
void with_tokens(int T, F f) {  // f(std::integral_constant) for the token counts the probe's cases use
  switch (T) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 8: f(std::integral_constant<int, 8>()); break;
    default: std::fprintf(stderr, "tokens per expert %d: not built (1, 2, 4, 8)\n", T); std::exit(2);
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// A call's routing: experts [0, E) of the call's stretch, each with the same number of tokens.
struct Case {
  const char* name;
  int tokens, top_k, experts;  // token t routes to experts (t * top_k + k) mod experts, k < top_k
  int per_expert() const { return tokens * top_k / experts; }
};

struct Call {
  const Shape& s;
  const Case& c;
  std::vector<const uint8_t*> expert;             // [E]
  std::vector<std::vector<int>> tok;              // [E][Te] tokens of each expert
  std::vector<std::vector<float>> wt;             // [E][Te] their gate weights
  std::vector<QAct> xq;                           // [tokens]
  std::vector<float> h;                           // [E][Te][I] (f32, for the check)
  std::vector<QAct> hq;                           // [E * Te]
  std::vector<float> y;                           // [tokens][H]
  Call(const Shape& s_, const Case& c_) : s(s_), c(c_), expert(c_.experts), tok(c_.experts), wt(c_.experts),
      xq(c_.tokens, QAct(s_.H)), h(size_t(c_.experts) * c_.per_expert() * s_.I), hq(size_t(c_.experts) * c_.per_expert(), QAct(s_.I)),
      y(size_t(c_.tokens) * s_.H) {
    for (int t = 0; t < c.tokens; ++t)
      for (int k = 0; k < c.top_k; ++k) {
        const int e = (t * c.top_k + k) % c.experts;
        tok[e].push_back(t);
        wt[e].push_back(1.f / c.top_k + 0.01f * k);
      }
    for (int e = 0; e < c.experts; ++e)
      if (static_cast<int>(tok[e].size()) != c.per_expert()) {
        std::fprintf(stderr, "case %s: expert %d has %zu tokens, not %d\n", c.name, e, tok[e].size(), c.per_expert());
        std::exit(2);
      }
  }
};

template <int Bits>
void run_call_bits(Team& team, Call& call, const std::vector<float>& x, int pf, bool contiguous) {
  const Shape& s = call.s;
  const int E = call.c.experts, Te = call.c.per_expert();
  constexpr int kQuantChunk = 512;  // round 0: the tokens' activations in int8, 512 values an item
  team.run(int64_t(call.c.tokens) * (s.H / kQuantChunk), [&](int64_t item, int) {
    const int t = static_cast<int>(item / (s.H / kQuantChunk)), k0 = static_cast<int>(item % (s.H / kQuantChunk)) * kQuantChunk;
    QAct& q = call.xq[t];
    for (int k = k0; k < k0 + kQuantChunk; k += kGroup)
      quantize_group(&x[size_t(t) * s.H + k], Bits, q, k);
  });
  const int64_t gu_items = int64_t(E) * (s.I / kGroup);
  with_tokens(Te, [&](auto TT) {
    constexpr int T = decltype(TT)::value;
    team.run(gu_items, [&](int64_t item, int) {
      const int e = static_cast<int>(item / (s.I / kGroup)), i = static_cast<int>(item % (s.I / kGroup));
      const QAct* a[T];
      for (int t = 0; t < T; ++t) a[t] = &call.xq[call.tok[e][t]];
      float gate[T][kRows], up[T][kRows];
      for (int half = 0; half < 2; ++half) {
        const int64_t blk = int64_t(i) * 2 + half;
        block_dot<T, Bits>(gu_block(call.expert[e], s, blk, 0), s.H / kGroup, nullptr, a, pf, gate);
        block_dot<T, Bits>(gu_block(call.expert[e], s, blk, 1), s.H / kGroup, nullptr, a, pf, up);
        for (int t = 0; t < T; ++t)
          for (int r = 0; r < kRows; ++r)
            call.h[(size_t(e) * T + t) * s.I + blk * kRows + r] = silu(gate[t][r]) * up[t][r];
      }
      for (int t = 0; t < T; ++t) {
        QAct& q = call.hq[size_t(e) * T + t];
        quantize_group(&call.h[(size_t(e) * T + t) * s.I + i * kGroup], Bits, q, i * kGroup);
      }
    }, contiguous);
    team.run(s.H / kRows, [&](int64_t blk, int) {
      float part[T][kRows];
      for (int t = 0; t < call.c.tokens; ++t) std::memset(&call.y[size_t(t) * s.H + blk * kRows], 0, sizeof(float) * kRows);
      for (int e = 0; e < E; ++e) {
        const QAct* a[T];
        for (int t = 0; t < T; ++t) a[t] = &call.hq[size_t(e) * T + t];
        block_dot<T, Bits>(down_block(call.expert[e], s, blk), s.I / kGroup,
                           e + 1 < E ? down_block(call.expert[e + 1], s, blk) : nullptr, a, pf, part);
        for (int t = 0; t < T; ++t) {
          float* yt = &call.y[size_t(call.tok[e][t]) * s.H + blk * kRows];
          for (int r = 0; r < kRows; ++r) yt[r] += call.wt[e][t] * part[t][r];
        }
      }
    }, contiguous);
  });
}

struct Variant {
  int bits, pf;     // activations in 8 or 15 bits (0: the loads alone); software prefetch distance (B ahead, 0: off)
  bool contiguous;  // each thread one stretch of a round's items (else: claimed one at a time)
};

void run_call(Team& team, Call& call, const std::vector<float>& x, Variant var) {
  if (var.bits == 15) run_call_bits<15>(team, call, x, var.pf, var.contiguous);
  else if (var.bits == 8) run_call_bits<8>(team, call, x, var.pf, var.contiguous);
  else run_call_bits<0>(team, call, x, var.pf, var.contiguous);
}


// ---- the reference: double precision over the decoded layout ----
inline int nibble(const uint8_t* tile, int r, int k) {  // row r (< 16), input k (< 32) of a tile
  const uint8_t b = tile[64 * (k / 8) + 4 * r + (k % 4)];
  return (k % 8) < 4 ? (b & 0x0F) : (b >> 4);
}
inline double bf16_at(const uint8_t* tile, int r) {
  uint16_t v;
  std::memcpy(&v, tile + 256 + 2 * r, 2);
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Row r of a block: the quantized dot (what the kernel computes) and the unquantized one (weights dequantized, x as is).
void ref_row(const uint8_t* blk, int n_groups, int r, const QAct& a, int bits, const float* x, double* quant,
             double* exact) {
  double qs = 0, es = 0;
  for (int g = 0; g < n_groups; ++g) {
    const uint8_t* tile = blk + int64_t(g) * kTile;
    const double ws = bf16_at(tile, r);
    int64_t dot = 0;
    for (int k = 0; k < kGroup; ++k) {
      const int w = nibble(tile, r, k) - 8;
      dot += int64_t(w) * a.value(g * kGroup + k, bits);
      es += w * ws * x[g * kGroup + k];
    }
    qs += ws * a.scale[g] * double(dot);
  }
  *quant = qs;
  *exact = es;
}

struct Check {
  double h_err = 0, y_err = 0, q8_err = 0;  // max |diff| / max |ref| over the call: h and y against the quantized
                                            // reference, y against the unquantized one
};
Check check_call(Team& team, const Call& call, const std::vector<float>& x, int bits) {
  const Shape& s = call.s;
  const int E = call.c.experts, T = call.c.per_expert();
  // per (expert, token) pair: h's largest reference value and difference, and its down rows' contributions
  std::vector<double> h_max(size_t(E) * T), h_diff(size_t(E) * T), yq(size_t(E) * T * s.H), ye(size_t(E) * T * s.H);
  team.run(int64_t(E) * T, [&](int64_t pair, int) {
    const int e = static_cast<int>(pair / T), t = static_cast<int>(pair % T), tk = call.tok[e][t];
    const float* xt = &x[size_t(tk) * s.H];
    std::vector<float> h_exact(s.I);
    double hm = 0, hd = 0;
    for (int j = 0; j < s.I; ++j) {
      double gq, ge, uq, ue;
      const int64_t blk = j / kRows;
      ref_row(gu_block(call.expert[e], s, blk, 0), s.H / kGroup, j % kRows, call.xq[tk], bits, xt, &gq, &ge);
      ref_row(gu_block(call.expert[e], s, blk, 1), s.H / kGroup, j % kRows, call.xq[tk], bits, xt, &uq, &ue);
      const double hq = gq / (1 + std::exp(-gq)) * uq;
      h_exact[j] = static_cast<float>(ge / (1 + std::exp(-ge)) * ue);
      hm = std::max(hm, std::fabs(hq));
      hd = std::max(hd, std::fabs(hq - call.h[size_t(pair) * s.I + j]));
    }
    h_max[pair] = hm;
    h_diff[pair] = hd;
    const QAct& a = call.hq[size_t(pair)];  // the down reference takes the kernel's own int8 h
    for (int r = 0; r < s.H; ++r) {
      double dq, de;
      ref_row(down_block(call.expert[e], s, r / kRows), s.I / kGroup, r % kRows, a, bits, h_exact.data(), &dq, &de);
      yq[size_t(pair) * s.H + r] = call.wt[e][t] * dq;
      ye[size_t(pair) * s.H + r] = call.wt[e][t] * de;
    }
  });
  std::vector<double> y_quant(call.y.size(), 0.0), y_exact(call.y.size(), 0.0);
  for (int e = 0; e < E; ++e)
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < s.H; ++r) {
        const size_t pair = size_t(e) * T + t, out = size_t(call.tok[e][t]) * s.H + r;
        y_quant[out] += yq[pair * s.H + r];
        y_exact[out] += ye[pair * s.H + r];
      }
  double hm = 0, hd = 0, y_max = 0, y_diff = 0, e_max = 0, e_diff = 0;
  for (size_t p = 0; p < h_max.size(); ++p) hm = std::max(hm, h_max[p]), hd = std::max(hd, h_diff[p]);
  for (size_t i = 0; i < call.y.size(); ++i) {
    y_max = std::max(y_max, std::fabs(y_quant[i]));
    y_diff = std::max(y_diff, std::fabs(y_quant[i] - call.y[i]));
    e_max = std::max(e_max, std::fabs(y_exact[i]));
    e_diff = std::max(e_diff, std::fabs(y_exact[i] - call.y[i]));
  }
  Check c;
  c.h_err = hd / std::max(hm, 1e-30);
  c.y_err = y_diff / std::max(y_max, 1e-30);
  c.q8_err = e_diff / std::max(e_max, 1e-30);
  return c;
}

uint64_t xorshift(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  double window_gib = 2.0;
  int threads = static_cast<int>(std::thread::hardware_concurrency()) - 1, calls = 200;
  std::vector<int> pfs = {0}, bits = {8, 15}, splits = {0};
  bool check_only = false, stream_variants = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    auto ints = [&](std::vector<int>& out) {
      out.clear();
      for (const char* p = next(); *p;) { out.push_back(std::atoi(p)); while (*p && *p != ',') ++p; if (*p) ++p; }
    };
    if (a == "--window-gib") window_gib = std::atof(next());
    else if (a == "--threads") threads = std::atoi(next());
    else if (a == "--calls") calls = std::atoi(next());
    else if (a == "--prefetch") ints(pfs);
    else if (a == "--act-bits") ints(bits);
    else if (a == "--contiguous") ints(splits);
    else if (a == "--check-only") check_only = true;
    else if (a == "--stream-variants") stream_variants = true;
    else {
      std::fprintf(stderr, "usage: %s [--window-gib G] [--threads N] [--calls C] [--prefetch B[,B...]] [--act-bits 0,8,15] [--contiguous 0,1] [--check-only] [--stream-variants]\n", argv[0]);
      return 2;
    }
  }
#ifndef INT4_EMULATE
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
    std::fprintf(stderr, "this CPU has no AVX-512 VNNI / BW: build with -DINT4_EMULATE to check the arithmetic\n");
    return 2;
  }
#endif
  threads = std::max(1, threads);
  const Shape shapes[] = {{"qwen3.6 (H2048 I512)", 2048, 512}, {"large (H4096 I2048)", 4096, 2048}};
  const Case cases[] = {{"1 x 8", 1, 8, 8},   {"1 x 1", 1, 1, 1},     {"1 x 2", 1, 2, 2},
                        {"8 x 8 (4 per expert)", 8, 8, 16}, {"8 x 8 (2 per expert)", 8, 8, 32},
                        {"8 x 8 (8 per expert)", 8, 8, 8}};
  const size_t window = static_cast<size_t>(window_gib * double(1ull << 30)) / (1 << 21) * (1 << 21);
  uint8_t* pool = static_cast<uint8_t*>(std::aligned_alloc(1 << 21, window));
  if (!pool) { std::perror("aligned_alloc"); return 1; }
  madvise(pool, window, MADV_HUGEPAGE);
  Team team(threads);
  // Fill: random nibbles, scales in [2^-8, 2^-7) (bf16), tile by tile (the window is a sequence of tiles).
  const int64_t n_tiles = static_cast<int64_t>(window / kTile), chunk = 4096;
  team.run((n_tiles + chunk - 1) / chunk, [&](int64_t c, int) {
    uint64_t st = 0x9E3779B97F4A7C15ull ^ (uint64_t(c) * 0xD1B54A32D192ED03ull);
    for (int64_t t = c * chunk; t < std::min(n_tiles, (c + 1) * chunk); ++t) {
      uint8_t* tile = pool + t * kTile;
      for (int b = 0; b < 256; b += 8) { const uint64_t r = xorshift(st); std::memcpy(tile + b, &r, 8); }
      for (int r = 0; r < kRows; ++r) {
        const uint16_t v = static_cast<uint16_t>((119u << 7) | (xorshift(st) & 0x7F));
        std::memcpy(tile + 256 + 2 * r, &v, 2);
      }
    }
  });
  if (stream_variants) {  // the read ceiling itself: items of 256 KiB / 2 MiB x loads of 32 / 64 bytes, round robin
    std::printf("STREAM-like read of %.2f GiB by %d threads, best of 8, variants round robin\n| item | loads | GB/s |\n|---|---|---|\n",
                double(window) / (1ull << 30), threads);
    const size_t items[2] = {size_t(256) << 10, size_t(2) << 20};
    double best[2][2] = {};
    std::vector<uint64_t> sink(window >> 18);
    for (int rep = 0; rep < 8; ++rep)
      for (int i = 0; i < 2; ++i)
        for (int w = 0; w < 2; ++w) {
          const size_t item = items[i];
          const double t0 = now();
          team.run(static_cast<int64_t>(window / item), [&](int64_t b, int) {
            sink[b] = w ? stream_chunk(pool + b * item, item) : stream_chunk32(pool + b * item, item);
          });
          best[i][w] = std::max(best[i][w], double(window) / (now() - t0) / 1e9);
        }
    for (int i = 0; i < 2; ++i)
      for (int w = 0; w < 2; ++w)
        std::printf("| %zu KiB | %d B | %.1f |\n", items[i] >> 10, w ? 64 : 32, best[i][w]);
    uint64_t s = 0;
    for (auto v : sink) s ^= v;
    return s == 42 ? 3 : 0;
  }
  // STREAM-like read of the window by the same threads (best of 3).
  double stream = 0;
  {
    const int64_t blocks = static_cast<int64_t>(window >> 21);
    std::vector<uint64_t> sink(blocks);
    for (int rep = 0; rep < 3; ++rep) {
      const double t0 = now();
      team.run(blocks, [&](int64_t b, int) { sink[b] = stream_chunk(pool + (size_t(b) << 21), size_t(1) << 21); });
      stream = std::max(stream, double(window) / (now() - t0) / 1e9);
    }
    uint64_t s = 0;
    for (auto v : sink) s ^= v;
    if (s == 42) std::printf(" ");
  }
  std::printf("int4 r16 probe: %d threads, window %.2f GiB, STREAM read %.1f GB/s (same threads)%s\n", threads,
              double(window) / (1ull << 30), stream,
#ifdef INT4_EMULATE
              " [scalar stand-ins: times mean nothing]"
#else
              ""
#endif
  );
  std::vector<Variant> variants;
  for (int b : bits) {
    if (b != 0 && b != 8 && b != 15) { std::fprintf(stderr, "--act-bits: 0 (loads only), 8 or 15, got %d\n", b); return 2; }
    for (int pf : pfs)
      for (int c : splits) variants.push_back({b, pf, c != 0});
  }
  std::printf("| shape | case | act bits | prefetch B | items | us/call (median) | GB/s | /STREAM | h err | y err | y err vs unquantized |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  int failures = 0;
  for (const Shape& s : shapes) {
    const int64_t n_experts = static_cast<int64_t>(window / s.expert_bytes());
    int64_t cursor = 0;
    for (const Case& c : cases) {
      if (c.experts > n_experts / 4) continue;
      Call call(s, c);
      std::vector<float> x(size_t(c.tokens) * s.H);
      uint64_t st = 12345;
      for (auto& v : x) v = static_cast<float>(static_cast<double>(xorshift(st) >> 11) / double(1ull << 53) * 2 - 1);
      auto place = [&]() {  // the call's experts: the next stretch of the pool (fresh, wrapping)
        for (int e = 0; e < c.experts; ++e) call.expert[e] = pool + ((cursor + e) % n_experts) * s.expert_bytes();
        cursor = (cursor + c.experts) % n_experts;
      };
      const int n_calls = check_only ? 1 : calls;
      std::vector<std::vector<double>> times(variants.size());
      for (int i = 0; i < n_calls; ++i)
        for (size_t v = 0; v < variants.size(); ++v) {  // the variants round robin, each call on fresh experts
          place();
          const double t0 = now();
          run_call(team, call, x, variants[v]);
          times[v].push_back(now() - t0);
        }
      const double bytes = double(c.experts) * s.expert_bytes();
      for (size_t v = 0; v < variants.size(); ++v) {
        place();
        run_call(team, call, x, variants[v]);
        const Check ck = variants[v].bits ? check_call(team, call, x, variants[v].bits) : Check();
        const bool ok = ck.h_err < 1e-4 && ck.y_err < 1e-4;  // (the loads alone are not checked)
        failures += !ok;
        auto& t = times[v];
        const size_t skip = std::min<size_t>(t.size() / 10, 10);  // warm-up calls
        std::vector<double> kept(t.begin() + skip, t.end());
        std::sort(kept.begin(), kept.end());
        const double med = kept[kept.size() / 2];
        char errs[96] = "- | - | -";
        if (variants[v].bits)
          std::snprintf(errs, sizeof errs, "%.1e | %.1e%s | %.1e", ck.h_err, ck.y_err, ok ? "" : " FAIL", ck.q8_err);
        std::printf("| %s | %s | %s | %d | %s | %.1f | %.1f | %.2f | %s |\n", s.name, c.name,
                    variants[v].bits ? std::to_string(variants[v].bits).c_str() : "loads only", variants[v].pf,
                    variants[v].contiguous ? "a stretch per thread" : "claimed",
                    med * 1e6, bytes / med / 1e9, bytes / med / 1e9 / stream, errs);
      }
      std::fflush(stdout);
    }
  }
  std::free(pool);
  if (failures) std::printf("%d case(s) FAILED the check against the reference\n", failures);
  return failures ? 1 : 0;
}
