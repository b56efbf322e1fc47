// Run-time choice of the kernel tier: the best one compiled in and supported by this CPU, unless
// forced (tests run every available tier; benchmarks compare them).
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cpu_features.h"
#include "kernels.h"

namespace ftjax {
namespace {
bool compiled(Tier t) {
  switch (t) {
    case Tier::kScalar: return true;
#ifdef FTJAX_HAVE_AVX2
    case Tier::kAvx2: return true;
#endif
#ifdef FTJAX_HAVE_AVX512BF16
    case Tier::kAvx512Bf16: return true;
#endif
#ifdef FTJAX_HAVE_AMX
    case Tier::kAmx: return true;
#endif
    default: return false;
  }
}

bool supported(Tier t) {
  static const CpuFeatures f = detect_cpu_features();
  switch (t) {
    case Tier::kScalar: return true;
    case Tier::kAvx2: return f.avx2 && f.fma;
    // VNNI: every CPU with AVX512-BF16 has it (Cooper Lake, Sapphire Rapids on, Zen 4 on)
    case Tier::kAvx512Bf16: return f.avx512f && f.avx512bw && f.avx512vl && f.avx512bf16 && f.avx512vnni;
    case Tier::kAmx:
      return f.amx_tile && f.amx_bf16 && f.avx512bf16 && f.avx512bw && f.avx512vl && f.avx512vnni && amx_enable();
  }
  return false;
}

// The fastest measured tier, AMX where present: it hands calls of fewer than 3 tokens per expert
// to the AVX-512 loops and is faster from 3 on (H200 host, 8 tokens x top-8, 15 threads: bf16 0.74
// / 0.88 of STREAM against 0.63 / 0.76, bench/RESULTS.md session 14).
Tier best_tier() { return available_tiers().back(); }

std::atomic<int> g_tier{-1};
std::atomic<int64_t> g_prefetch{kDefaultPrefetchBytes};
std::atomic<int64_t> g_short_rows{kShortRowBytes};
std::atomic<bool> g_window_prefetch{true};
std::atomic<bool> g_tile_prefetch{false};
std::atomic<int64_t> g_int4_vnni_tokens{-1};  // -1: the default for this CPU, on first read
std::atomic<int> g_int4_act_bits{15};
std::atomic<int64_t> g_int4_q8_tokens{-1};  // -1: the default for this CPU, on first read
}  // namespace

#ifndef FTJAX_HAVE_AMX
bool amx_enable() { return false; }
#endif

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kScalar: return "scalar";
    case Tier::kAvx2: return "avx2";
    case Tier::kAvx512Bf16: return "avx512bf16";
    case Tier::kAmx: return "amx";
  }
  return "?";
}

std::vector<Tier> available_tiers() {
  std::vector<Tier> out;
  for (Tier t : {Tier::kScalar, Tier::kAvx2, Tier::kAvx512Bf16, Tier::kAmx})
    if (compiled(t) && supported(t)) out.push_back(t);
  return out;
}

Tier active_tier() {
  int t = g_tier.load();
  if (t < 0) {
    t = static_cast<int>(best_tier());
    g_tier.store(t);
  }
  return static_cast<Tier>(t);
}

void set_tier(const std::string& name) {
  if (name == "auto") {
    g_tier.store(static_cast<int>(best_tier()));
    return;
  }
  std::string valid;
  for (Tier t : available_tiers()) {
    if (name == tier_name(t)) {
      g_tier.store(static_cast<int>(t));
      return;
    }
    valid += std::string(valid.empty() ? "" : ", ") + tier_name(t);
  }
  throw std::invalid_argument("kernel tier '" + name + "' is not available on this machine/build; valid: auto, " +
                              valid);
}

int64_t prefetch_bytes() { return g_prefetch.load(std::memory_order_relaxed); }

void set_prefetch_bytes(int64_t bytes) {
  if (bytes < 0 || bytes > (int64_t{1} << 20))
    throw std::invalid_argument("prefetch distance must be in [0, 1 MiB] bytes, got " + std::to_string(bytes));
  g_prefetch.store(bytes, std::memory_order_relaxed);
}

bool window_prefetch() { return g_window_prefetch.load(std::memory_order_relaxed); }
void set_window_prefetch(bool on) { g_window_prefetch.store(on, std::memory_order_relaxed); }
bool tile_prefetch() { return g_tile_prefetch.load(std::memory_order_relaxed); }
void set_tile_prefetch(bool on) { g_tile_prefetch.store(on, std::memory_order_relaxed); }
int64_t int4_vnni_tokens() {
  const int64_t t = g_int4_vnni_tokens.load(std::memory_order_relaxed);
  if (t >= 0) return t;
  const Tier best = best_tier();
  const int64_t d = best == Tier::kAmx ? kInt4VnniTokensAmx : best == Tier::kAvx2 ? kInt4VnniTokensAvx2 : kInt4VnniTokens;
  g_int4_vnni_tokens.store(d, std::memory_order_relaxed);
  return d;
}
void set_int4_vnni_tokens(int64_t tokens) {
  if (tokens < 0 || tokens > 64)
    throw std::invalid_argument("int4 VNNI tokens must be in [0, 64], got " + std::to_string(tokens));
  g_int4_vnni_tokens.store(tokens, std::memory_order_relaxed);
}

int64_t int4_q8_tokens() {
  const int64_t t = g_int4_q8_tokens.load(std::memory_order_relaxed);
  if (t >= 0) return t;
  const int64_t d = best_tier() == Tier::kAvx2 ? kInt4VnniTokensAvx2 : kInt4Q8Tokens;
  g_int4_q8_tokens.store(d, std::memory_order_relaxed);
  return d;
}
void set_int4_q8_tokens(int64_t tokens) {
  if (tokens < 0 || tokens > 64)
    throw std::invalid_argument("int4 q8 tokens must be in [0, 64], got " + std::to_string(tokens));
  g_int4_q8_tokens.store(tokens, std::memory_order_relaxed);
}
int64_t int4_vnni_limit() { return int4_act_bits() == 8 ? int4_q8_tokens() : int4_vnni_tokens(); }
int int4_act_bits() { return g_int4_act_bits.load(std::memory_order_relaxed); }
void set_int4_act_bits(int bits) {
  if (bits != 15 && bits != 8)
    throw std::invalid_argument("int4 activation bits must be 15 (exact) or 8, got " + std::to_string(bits));
  g_int4_act_bits.store(bits, std::memory_order_relaxed);
}

int64_t short_row_bytes() { return g_short_rows.load(std::memory_order_relaxed); }

void set_short_row_bytes(int64_t bytes) {
  if (bytes < 0 || bytes > (int64_t{1} << 20))
    throw std::invalid_argument("short-row limit must be in [0, 1 MiB] bytes, got " + std::to_string(bytes));
  g_short_rows.store(bytes, std::memory_order_relaxed);
}

DotRowsFn dot_rows_for(Tier t) {
  switch (t) {
#ifdef FTJAX_HAVE_AVX2
    case Tier::kAvx2: return dot_rows_avx2;
#endif
#ifdef FTJAX_HAVE_AVX512BF16
    case Tier::kAvx512Bf16: return dot_rows_avx512bf16;
#endif
#ifdef FTJAX_HAVE_AMX
    case Tier::kAmx: return dot_rows_amx;
#endif
    default: return dot_rows_scalar;
  }
}

AxpyRowsFn axpy_rows_for(Tier t) {
  switch (t) {
#ifdef FTJAX_HAVE_AVX2
    case Tier::kAvx2: return axpy_rows_avx2;
#endif
#ifdef FTJAX_HAVE_AVX512BF16
    case Tier::kAvx512Bf16:
    case Tier::kAmx: return axpy_rows_avx512;
#endif
    default: return axpy_rows_scalar;
  }
}

AmxRoute amx_route(WeightFormat format, int n_tokens, bool bf16_act, bool vnni_given, int64_t K, int64_t rows) {
  // Fewer tokens than kAmxMinTokens: the AVX-512 loops are faster (they do not pay for the unused
  // tile columns; dev-box Xeon, one core: bf16 27 vs 20 GB/s at 1 token, int4 12.6 vs 8.3).
  if (n_tokens < kAmxMinTokens || !bf16_act || rows < 16) return AmxRoute::kAvx512;
  if (format == WeightFormat::kInt4) return vnni_given ? AmxRoute::kInt4 : AmxRoute::kAvx512;
  if (format == WeightFormat::kBF16 && K >= 32) return AmxRoute::kBf16;
  return AmxRoute::kAvx512;
}

namespace {
struct RouteCounts {  // one per thread that ever ran the AMX tier, never freed (a few bytes each)
  std::atomic<int64_t> n[3] = {};
};
std::mutex g_route_mu;
std::vector<RouteCounts*>& route_registry() {
  static std::vector<RouteCounts*> all;
  return all;
}
RouteCounts& my_route_counts() {
  thread_local RouteCounts* mine = [] {
    auto* c = new RouteCounts();
    std::lock_guard<std::mutex> lock(g_route_mu);
    route_registry().push_back(c);
    return c;
  }();
  return *mine;
}
}  // namespace

void count_amx_route(AmxRoute r) {  // the owning thread is the only writer: no atomic RMW
  std::atomic<int64_t>& c = my_route_counts().n[static_cast<int>(r)];
  c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

std::vector<int64_t> amx_route_counts() {
  std::vector<int64_t> out(3, 0);
  std::lock_guard<std::mutex> lock(g_route_mu);
  for (const RouteCounts* c : route_registry())
    for (int i = 0; i < 3; ++i) out[i] += c->n[i].load(std::memory_order_relaxed);
  return out;
}

MatrixRef matrix_of(const Bank& bank, int64_t expert) {
  const uint8_t* base = bank.expert(expert);
  MatrixRef m{bank.format, bank.rows, bank.cols, base, nullptr, bank.cols};
  if (bank.format == WeightFormat::kInt4)
    m.scales = reinterpret_cast<const uint16_t*>(base + static_cast<size_t>(bank.rows) * bank.cols / 2);
  return m;
}

void pack_vnni(const uint16_t* xj, int64_t K, int64_t k0, int64_t k1, int n, int j, uint32_t* dst, bool int4_order) {
#ifdef FTJAX_HAVE_AVX512BF16
  pack_vnni_avx512(xj, K, k0, std::min(k1, vnni_pairs(K) * 2), n, j, dst, int4_order);
#else
  throw std::logic_error("pack_vnni: only the AMX tier reads this layout, and this build has no AVX-512");
#endif
}

void dot_rows_sum(const MatrixRef* ws, const ActRef* as, const float* wts, int n, int64_t r0, int64_t r1, float* out) {
#ifdef FTJAX_HAVE_AVX512BF16
  for (int m = 0; m < n; ++m)
    if (as[m].n != 1) throw std::logic_error("dot_rows_sum: one activation vector per matrix, got " + std::to_string(as[m].n));
  dot_rows_sum_avx512bf16(ws, as, wts, n, r0, r1, out);
#else
  throw std::logic_error("dot_rows_sum: only the AVX-512 tiers have it, and this build has none");
#endif
}

namespace {
using ToQFn = void (*)(const uint16_t*, int64_t, int64_t, int8_t*, int64_t);

// The writer this CPU runs: in AVX-512 where the AVX-512 tiers run, else in AVX2 (nullptr: neither).
ToQFn q_writer(bool q8) {
#ifdef FTJAX_HAVE_AVX512BF16
  if (supported(Tier::kAvx512Bf16)) return q8 ? to_q8_avx512 : to_q15_avx512;
#endif
#ifdef FTJAX_HAVE_AVX2
  if (supported(Tier::kAvx2)) return q8 ? to_q8_avx2 : to_q15_avx2;
#endif
  return nullptr;
}

// to_q15 / to_q8: whole lanes inside the vector
void to_q_checked(const char* name, bool q8, const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S) {
  if (k0 % 8 || k1 % 8 || k0 < 0 || k1 > 2 * S)
    throw std::logic_error(std::string(name) + ": columns [" + std::to_string(k0) + ", " + std::to_string(k1) +
                           ") are not whole lanes of 8 inside the vector");
  static const ToQFn q15 = q_writer(false), q8w = q_writer(true);
  if (q15 == nullptr)
    throw std::logic_error(std::string(name) + ": only the AVX2 and AVX-512 tiers read this layout, and this build or "
                           "CPU has neither");
  (q8 ? q8w : q15)(x, k0, k1, base, S);
}
}  // namespace

void to_q15(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S) {
  to_q_checked("to_q15", false, x, k0, k1, base, S);
}
void to_q8(const uint16_t* x, int64_t k0, int64_t k1, int8_t* base, int64_t S) {
  to_q_checked("to_q8", true, x, k0, k1, base, S);
}

void to_pair64(const uint16_t* x, int64_t K, uint16_t* dst) {
#ifdef FTJAX_HAVE_AVX512BF16
  if (K % 64) throw std::logic_error("to_pair64: K must be a multiple of 64, got " + std::to_string(K));
  to_pair64_avx512(x, K, dst);
#else
  throw std::logic_error("to_pair64: only the AVX-512 tiers read this layout, and this build has none");
#endif
}

MatrixRef column_window(const MatrixRef& w, int64_t c0, int64_t n) {
  if (c0 < 0 || n < 0 || c0 + n > w.cols)
    throw std::invalid_argument("column window [" + std::to_string(c0) + ", " + std::to_string(c0 + n) +
                                ") is outside the matrix's " + std::to_string(w.cols) + " columns");
  MatrixRef m = w;
  m.cols = n;
  switch (w.format) {
    case WeightFormat::kF32: m.data += c0 * 4; break;
    case WeightFormat::kBF16: m.data += c0 * 2; break;
    case WeightFormat::kInt4:
      if (c0 % 32 || n % 32)
        throw std::invalid_argument("an int4 column window must start and end on a 32-column group, got [" +
                                    std::to_string(c0) + ", " + std::to_string(c0 + n) + ")");
      m.data += c0 / 2;
      m.scales += c0 / 32;
      break;
  }
  return m;
}

}  // namespace ftjax
