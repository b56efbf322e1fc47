// A probe, not the runtime: would a host down layout of [I, H] (unit i's down column stored as a row) let the CPU
// branch of a unit-split miss read its window [u, I) at gate/up's rate, and by how much would the in-step CPU
// job shrink? (issue 4, batch 1: the job reads ~1.5 experts' units [u, I) at 55-65 GB/s inside the step; standalone,
// the runtime's down window at u = 192 reads at 0.80 of its whole rows' rate and ~0.75 of gate/up's, bench/RESULTS.md
// session 26: each down row [H, I] gives the window 640 of its 1,024 bytes, and the hardware's stream prefetchers start
// over on every row's 4 KiB page.)
//
//   g++ -O2 -march=native -pthread -o /tmp/down_layout bench/down_layout.cc && /tmp/down_layout
//
// One pool of random bf16 experts (finite values), larger than the caches, read in three layouts of the same bytes:
//   rows        gate [I, H], up [I, H], down [H, I]  (the runtime's: down's window is a column window)
//   units       gate [I, H], up [I, H], down^T [I, H] (the window is I - u whole rows of each matrix)
//   interleaved per unit i: gate row i, up row i, down^T row i (the window is one contiguous stretch)
// and two call forms over the units [u, I) of E experts for T tokens, y[t] = sum_e w[t, e] down_e[:, u:] h_e,t[u:]:
//   rows:  round 1 items of 16 units of one expert (gate and up rows: h = silu(g) * up); round 2 items of 32 down
//          rows over every expert of the call (a dot product per row per token) - the runtime's form;
//   units / interleaved: round 1 items of 16 units of one expert: their gate and up rows, h, then the same units'
//          down^T rows added into the thread's own partial y (no barrier between gate/up and down); round 2: y as the
//          sum of the partials, items of 128 outputs.
// Threads: persistent, pinned, spinning between rounds (bench/probe_team.h). Every call reads experts no earlier call
// read since the pool last wrapped (pool >> caches); the forms run round robin, call by call. The ceiling is a
// STREAM-like read of the pool by the same threads in the same run (2 MiB blocks, 64-byte loads). Each case's first
// call is checked against a double-precision reference. Prints a table.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "probe_team.h"

namespace {

using probe::now;
using probe::Team;

constexpr int kUnitItem = 16, kDownRows = 32, kSumCols = 128, kMaxTokens = 4;

enum Layout { kRows = 0, kUnits = 1, kInterleaved = 2 };
const char* kLayoutNames[] = {"rows", "units", "interleaved"};

struct Shape {
  int64_t H, I;
  int64_t expert_bytes() const { return 3 * H * I * 2; }
};

// Where an expert's rows lie in each layout (element offsets from the expert's first bf16).
struct Rows {
  Shape s;
  Layout layout;
  int64_t gate(int64_t i) const { return layout == kInterleaved ? 3 * i * s.H : i * s.H; }
  int64_t up(int64_t i) const { return layout == kInterleaved ? (3 * i + 1) * s.H : (s.I + i) * s.H; }
  int64_t down_t(int64_t i) const { return layout == kInterleaved ? (3 * i + 2) * s.H : (2 * s.I + i) * s.H; }
  int64_t down(int64_t h) const { return 2 * s.I * s.H + h * s.I; }  // rows layout only: row h of [H, I]
};

inline float bf16_to_f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float silu(float g) { return g / (1.f + std::exp(-g)); }

#ifdef __AVX512F__
inline __m512 lo16(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16)); }
inline __m512 hi16(__m512i w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
}
#endif

inline void prefetch(const void* p) {
#ifdef __AVX512F__
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  (void)p;
#endif
}

// out[t] = dot(w[0:n], x[t][0:n]) for t < T; n % 32 == 0; pf > 0: prefetch pf bytes ahead, not past w + n.
void dot_row(const uint16_t* w, int64_t n, const float* const* x, int T, float* out, int64_t pf) {
#ifdef __AVX512F__
  __m512 acc[kMaxTokens][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  const int64_t pf_el = pf / 2;
  for (int64_t k = 0; k < n; k += 32) {
    if (pf_el > 0 && k % 32 == 0 && k + pf_el < n) prefetch(w + k + pf_el);
    const __m512i v = _mm512_loadu_si512(w + k);
    const __m512 a = lo16(v), b = hi16(v);
    for (int t = 0; t < T; ++t) {
      acc[t][0] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x[t] + k), acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x[t] + k + 16), acc[t][1]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
#else
  (void)pf;
  for (int t = 0; t < T; ++t) {
    float s = 0.f;
    for (int64_t k = 0; k < n; ++k) s += bf16_to_f32(w[k]) * x[t][k];
    out[t] = s;
  }
#endif
}

// y[t][0:n] += sum_r c[r][t] * w_r[0:n], r < R (R <= 4): a few down^T rows into a partial y; n % 32 == 0.
void axpy_rows(const uint16_t* const* w, int R, const float (*c)[kMaxTokens], int T, float* const* y, int64_t n,
               int64_t pf) {
#ifdef __AVX512F__
  const int64_t pf_el = pf / 2;
  for (int64_t k = 0; k < n; k += 32) {
    __m512 acc[kMaxTokens][2];
    for (int t = 0; t < T; ++t) {
      acc[t][0] = _mm512_loadu_ps(y[t] + k);
      acc[t][1] = _mm512_loadu_ps(y[t] + k + 16);
    }
    for (int r = 0; r < R; ++r) {
      if (pf_el > 0 && k + pf_el < n) prefetch(w[r] + k + pf_el);
      const __m512i v = _mm512_loadu_si512(w[r] + k);
      const __m512 a = lo16(v), b = hi16(v);
      for (int t = 0; t < T; ++t) {
        const __m512 ct = _mm512_set1_ps(c[r][t]);
        acc[t][0] = _mm512_fmadd_ps(a, ct, acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(b, ct, acc[t][1]);
      }
    }
    for (int t = 0; t < T; ++t) {
      _mm512_storeu_ps(y[t] + k, acc[t][0]);
      _mm512_storeu_ps(y[t] + k + 16, acc[t][1]);
    }
  }
#else
  (void)pf;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      for (int64_t k = 0; k < n; ++k) y[t][k] += c[r][t] * bf16_to_f32(w[r][k]);
#endif
}

struct Call {
  std::vector<const uint16_t*> experts;  // E experts
  std::vector<float> weights;            // [T][E]
  int T = 1;
  int64_t u = 0;
};

struct Probe {
  Shape s;
  Team& team;
  int64_t pf;
  std::vector<const float*> x;              // [T] activations, H each
  std::vector<float> h;                     // [E][T][I] (rows form)
  std::vector<std::vector<float>> partial;  // [thread][T * H]
  std::vector<int64_t> partial_call;        // the call that last zeroed a thread's partial
  std::vector<float> y;                     // [T][H]
  int64_t call_id = 0;
  double round1 = 0, round2 = 0;  // the last call's rounds (s)

  Probe(Shape s_, Team& t, int64_t pf_, const std::vector<float>& xs, int T)
      : s(s_), team(t), pf(pf_), partial(t.size(), std::vector<float>(kMaxTokens * s_.H)),
        partial_call(t.size(), -1), y(kMaxTokens * s_.H) {
    for (int k = 0; k < T; ++k) x.push_back(xs.data() + k * s.H);
  }

  void run(Layout layout, const Call& c) {
    const Rows rows{s, layout};
    const int E = static_cast<int>(c.experts.size()), T = c.T;
    const int64_t window = s.I - c.u, unit_items = (window + kUnitItem - 1) / kUnitItem;
    ++call_id;
    const double t0 = now();
    if (layout == kRows) {
      h.assign(static_cast<size_t>(E) * T * s.I, 0.f);
      team.run(E * unit_items, [&](int64_t item, int) {
        const int e = static_cast<int>(item / unit_items);
        const int64_t i0 = c.u + (item % unit_items) * kUnitItem, i1 = std::min(s.I, i0 + kUnitItem);
        const uint16_t* base = c.experts[e];
        for (int64_t i = i0; i < i1; ++i) {
          float g[kMaxTokens], v[kMaxTokens];
          dot_row(base + rows.gate(i), s.H, x.data(), T, g, pf);
          dot_row(base + rows.up(i), s.H, x.data(), T, v, pf);
          for (int t = 0; t < T; ++t) h[(static_cast<size_t>(e) * T + t) * s.I + i] = silu(g[t]) * v[t];
        }
      });
      round1 = now() - t0;
      team.run((s.H + kDownRows - 1) / kDownRows, [&](int64_t item, int) {
        const int64_t r0 = item * kDownRows, r1 = std::min(s.H, r0 + kDownRows);
        const float* he[kMaxTokens];
        for (int64_t r = r0; r < r1; ++r) {
          float acc[kMaxTokens] = {};
          for (int e = 0; e < E; ++e) {
            const uint16_t* w = c.experts[e] + rows.down(r) + c.u;
            if (pf > 0 && r + 4 < r1)  // the same window 4 rows on: its lines, whatever pf's size
              for (int64_t k = 0; k < window; k += 32) prefetch(w + 4 * s.I + k);
            for (int t = 0; t < T; ++t) he[t] = h.data() + (static_cast<size_t>(e) * T + t) * s.I + c.u;
            float d[kMaxTokens];
            dot_row(w, window, he, T, d, 0);
            for (int t = 0; t < T; ++t) acc[t] += c.weights[t * E + e] * d[t];
          }
          for (int t = 0; t < T; ++t) y[t * s.H + r] = acc[t];
        }
      });
    } else {
      team.run(E * unit_items, [&](int64_t item, int k) {
        std::vector<float>& p = partial[k];
        if (partial_call[k] != call_id) {
          std::fill(p.begin(), p.begin() + T * s.H, 0.f);
          partial_call[k] = call_id;
        }
        float* py[kMaxTokens];
        for (int t = 0; t < T; ++t) py[t] = p.data() + t * s.H;
        const int e = static_cast<int>(item / unit_items);
        const int64_t i0 = c.u + (item % unit_items) * kUnitItem, i1 = std::min(s.I, i0 + kUnitItem);
        const uint16_t* base = c.experts[e];
        for (int64_t i = i0; i < i1; i += 4) {
          const int R = static_cast<int>(std::min<int64_t>(4, i1 - i));
          float coef[4][kMaxTokens];
          const uint16_t* dw[4];
          for (int r = 0; r < R; ++r) {
            float g[kMaxTokens], v[kMaxTokens];
            dot_row(base + rows.gate(i + r), s.H, x.data(), T, g, pf);
            dot_row(base + rows.up(i + r), s.H, x.data(), T, v, pf);
            for (int t = 0; t < T; ++t) coef[r][t] = c.weights[t * E + e] * silu(g[t]) * v[t];
            dw[r] = base + rows.down_t(i + r);
          }
          axpy_rows(dw, R, coef, T, py, s.H, pf);
        }
      });
      round1 = now() - t0;
      team.run((s.H + kSumCols - 1) / kSumCols, [&](int64_t item, int) {
        const int64_t c0 = item * kSumCols, c1 = std::min(s.H, c0 + kSumCols);
        for (int t = 0; t < T; ++t) {
          float* out = y.data() + t * s.H;
          std::fill(out + c0, out + c1, 0.f);
          for (int k = 0; k < team.size(); ++k) {
            if (partial_call[k] != call_id) continue;
            const float* p = partial[k].data() + t * s.H;
            for (int64_t j = c0; j < c1; ++j) out[j] += p[j];
          }
        }
      });
    }
    round2 = now() - t0 - round1;
  }
};

// The largest |y - reference| over the largest |reference|, in double precision.
double check(const Probe& p, Layout layout, const Call& c) {
  const Rows rows{p.s, layout};
  const int E = static_cast<int>(c.experts.size());
  double err = 0, top = 0;
  for (int t = 0; t < c.T; ++t) {
    std::vector<double> ref(p.s.H, 0.0);
    for (int e = 0; e < E; ++e) {
      const uint16_t* base = c.experts[e];
      for (int64_t i = c.u; i < p.s.I; ++i) {
        double g = 0, v = 0;
        for (int64_t k = 0; k < p.s.H; ++k) {
          g += double(bf16_to_f32(base[rows.gate(i) + k])) * p.x[t][k];
          v += double(bf16_to_f32(base[rows.up(i) + k])) * p.x[t][k];
        }
        const double hv = c.weights[t * E + e] * (g / (1 + std::exp(-g))) * v;
        for (int64_t r = 0; r < p.s.H; ++r) {
          const uint16_t d = layout == kRows ? base[rows.down(r) + i] : base[rows.down_t(i) + r];
          ref[r] += hv * bf16_to_f32(d);
        }
      }
    }
    for (int64_t r = 0; r < p.s.H; ++r) {
      err = std::max(err, std::fabs(ref[r] - p.y[t * p.s.H + r]));
      top = std::max(top, std::fabs(ref[r]));
    }
  }
  return top > 0 ? err / top : err;
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  for (const char* p = s; *p;) {
    char* end;
    out.push_back(std::strtoll(p, &end, 10));
    if (end == p) {
      std::fprintf(stderr, "down_layout: bad number list '%s'\n", s);
      std::exit(2);
    }
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--pool-gib G] [--threads N] [--calls C] [--hidden H] [--inter I] [--starts u,u,...]\n"
               "          [--experts E,E,...] [--tokens T] [--prefetch B] [--check-only]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  double pool_gib = 2.0;
  int threads = 15, calls = 300, T = 1;
  int64_t pf = 0;
  Shape s{2048, 512};
  std::vector<int64_t> starts{0, 160, 192, 256}, experts{1, 2};
  bool check_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--pool-gib" && has) pool_gib = std::atof(argv[++i]);
    else if (a == "--threads" && has) threads = std::atoi(argv[++i]);
    else if (a == "--calls" && has) calls = std::atoi(argv[++i]);
    else if (a == "--hidden" && has) s.H = std::atoll(argv[++i]);
    else if (a == "--inter" && has) s.I = std::atoll(argv[++i]);
    else if (a == "--starts" && has) starts = parse_list(argv[++i]);
    else if (a == "--experts" && has) experts = parse_list(argv[++i]);
    else if (a == "--tokens" && has) T = std::atoi(argv[++i]);
    else if (a == "--prefetch" && has) pf = std::atoll(argv[++i]);
    else if (a == "--check-only") check_only = true;
    else return usage(argv[0]);
  }
  if (s.H % 32 || s.I % 32 || s.H <= 0 || s.I <= 0) {
    std::fprintf(stderr, "down_layout: hidden and inter must be positive multiples of 32\n");
    return 2;
  }
  if (T < 1 || T > kMaxTokens || threads < 1 || calls < 1) {
    std::fprintf(stderr, "down_layout: tokens in [1, %d], threads and calls >= 1\n", kMaxTokens);
    return 2;
  }
  for (int64_t u : starts)
    if (u < 0 || u >= s.I || u % 32) {
      std::fprintf(stderr, "down_layout: starts must be multiples of 32 in [0, inter)\n");
      return 2;
    }
  const int64_t n_experts = static_cast<int64_t>(pool_gib * (1ull << 30)) / s.expert_bytes();
  int64_t max_e = 0;
  for (int64_t e : experts) max_e = std::max(max_e, e);
  if (n_experts < 4 * max_e) {
    std::fprintf(stderr, "down_layout: the pool holds %lld experts, too few\n", static_cast<long long>(n_experts));
    return 2;
  }
  const size_t bytes = (static_cast<size_t>(n_experts) * s.expert_bytes() + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  madvise(mem, bytes, MADV_HUGEPAGE);
  uint16_t* pool = static_cast<uint16_t*>(mem);
  Team team(threads);
  const int64_t chunk = 1 << 20;  // elements per fill item: finite bf16, 2^-7 <= |w| < 2^-3
  const int64_t n_el = static_cast<int64_t>(bytes / 2);
  team.run((n_el + chunk - 1) / chunk, [&](int64_t c, int) {
    uint64_t z = 0x9E3779B97F4A7C15ull * (c + 1);
    for (int64_t i = c * chunk; i < std::min(n_el, (c + 1) * chunk); ++i) {
      z ^= z << 13, z ^= z >> 7, z ^= z << 17;
      pool[i] = static_cast<uint16_t>((z & 0x807F) | 0x3C00 | ((z >> 8) & 0x0180));
    }
  });
  std::vector<float> xs(kMaxTokens * s.H);
  uint64_t z = 12345;
  for (auto& v : xs) {
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    v = static_cast<float>(static_cast<int64_t>(z % 2001) - 1000) / 1000.f;
  }
  double stream = 0;  // GB/s: the pool read by the same threads, 2 MiB blocks, best of 5
  {
    const int64_t blocks = static_cast<int64_t>(bytes >> 21);
    std::vector<uint64_t> sink(blocks);
    for (int rep = 0; rep < 5; ++rep) {
      const double t0 = now();
      team.run(blocks, [&](int64_t b, int) {
        const uint8_t* p = reinterpret_cast<const uint8_t*>(pool) + (static_cast<size_t>(b) << 21);
        uint64_t acc = 0;
#ifdef __AVX512F__
        __m512i v0 = _mm512_setzero_si512(), v1 = v0;
        for (size_t o = 0; o < (size_t(1) << 21); o += 128) {
          v0 = _mm512_xor_si512(v0, _mm512_load_si512(p + o));
          v1 = _mm512_xor_si512(v1, _mm512_load_si512(p + o + 64));
        }
        acc = static_cast<uint64_t>(_mm512_reduce_add_epi64(_mm512_xor_si512(v0, v1)));
#else
        for (size_t o = 0; o < (size_t(1) << 21); o += 64) acc ^= *reinterpret_cast<const uint64_t*>(p + o);
#endif
        sink[b] = acc;
      });
      stream = std::max(stream, static_cast<double>(blocks << 21) / (now() - t0) / 1e9);
    }
    uint64_t all = 0;
    for (uint64_t v : sink) all ^= v;
    if (all == 42) std::printf(" ");  // keeps the reads
  }
  std::printf("down layout probe: H %lld, I %lld, %d threads, pool %.2f GiB (%lld experts), %d token(s), prefetch %lld B, "
              "STREAM read %.1f GB/s (same threads)%s\n",
              static_cast<long long>(s.H), static_cast<long long>(s.I), threads, bytes / double(1ull << 30),
              static_cast<long long>(n_experts), T, static_cast<long long>(pf), stream,
#ifdef __AVX512F__
              ""
#else
              " [no AVX-512: scalar loops, timings meaningless]"
#endif
  );
  Probe probe(s, team, pf, xs, T);
  int64_t next_expert = 0;
  auto make_call = [&](int E, int64_t u) {
    Call c;
    c.T = T;
    c.u = u;
    for (int e = 0; e < E; ++e) {
      c.experts.push_back(pool + (next_expert % n_experts) * (s.expert_bytes() / 2));
      ++next_expert;
    }
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) c.weights.push_back(0.5f + 0.25f * static_cast<float>((t + e) % 3));
    return c;
  };
  std::printf("\n| E | u | window MB | layout | median us | GB/s | / STREAM | round 1 us | round 2 us | rel err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  bool ok = true;
  for (int64_t E : experts)
    for (int64_t u : starts) {
      const double mb = static_cast<double>(E) * 3 * (s.I - u) * s.H * 2 / 1e6;
      double errs[3];
      for (int l = 0; l < 3; ++l) {
        const Call c = make_call(static_cast<int>(E), u);
        probe.run(static_cast<Layout>(l), c);
        errs[l] = check(probe, static_cast<Layout>(l), c);
        ok = ok && errs[l] < 1e-4;
      }
      std::vector<double> times[3], r1[3], r2[3];
      if (!check_only)
        for (int k = 0; k < calls; ++k)
          for (int l = 0; l < 3; ++l) {
            const Call c = make_call(static_cast<int>(E), u);
            const double t0 = now();
            probe.run(static_cast<Layout>(l), c);
            times[l].push_back(now() - t0);
            r1[l].push_back(probe.round1);
            r2[l].push_back(probe.round2);
          }
      auto median = [](std::vector<double> v) {
        if (v.empty()) return 0.0;
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        return v[v.size() / 2];
      };
      for (int l = 0; l < 3; ++l) {
        const double t = median(times[l]);
        std::printf("| %lld | %lld | %.2f | %s | %.1f | %.1f | %.2f | %.1f | %.1f | %.1e |\n", static_cast<long long>(E),
                    static_cast<long long>(u), mb, kLayoutNames[l], t * 1e6, t > 0 ? mb / 1e3 / t : 0.0,
                    t > 0 ? mb / 1e3 / t / stream : 0.0, median(r1[l]) * 1e6, median(r2[l]) * 1e6, errs[l]);
      }
    }
  munmap(mem, bytes);
  if (!ok) {
    std::printf("FAILED: a layout's result is off its reference by more than 1e-4\n");
    return 1;
  }
  return 0;
}
