#include "stream.h"

#include <algorithm>
#include <atomic>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ftjax {
namespace {
// 2 MiB blocks and, where the CPU has AVX-512, 64-byte loads: on the H200 host (15 threads, 2 GiB) these read at
// 143-150 GB/s, against 115-132 for 256 KiB blocks of 32-byte loads (what this read did until session 33: every
// "/ STREAM" ratio and B_DRAM before then was taken against a ceiling 10-15% too low; bench/RESULTS.md).
constexpr size_t kBlock = size_t(2) << 20;

#if defined(__x86_64__)
__attribute__((target("avx512f"))) uint64_t read_block_avx512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {  // four independent streams of 64-byte loads
    a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t out = 0;
  for (uint64_t v : lanes) out ^= v;
  for (; i < n; ++i) out ^= p[i];
  return out;
}

__attribute__((target("avx2"))) uint64_t read_block_avx2(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {  // four independent streams of 32-byte loads
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i s = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  uint64_t out = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  for (; i < n; ++i) out ^= p[i];
  return out;
}
#endif

uint64_t read_block_scalar(const uint8_t* p, size_t n) {
  uint64_t a = 0, b = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a ^= *reinterpret_cast<const uint64_t*>(p + i);
    b ^= *reinterpret_cast<const uint64_t*>(p + i + 8);
  }
  for (; i < n; ++i) a ^= p[i];
  return a ^ b;
}
}  // namespace

uint64_t read_all(WorkerPool& workers, const uint8_t* data, size_t bytes) {
  std::atomic<uint64_t> sum{0};
#if defined(__x86_64__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && reinterpret_cast<uintptr_t>(data) % 64 == 0;
  const bool avx2 = __builtin_cpu_supports("avx2") && reinterpret_cast<uintptr_t>(data) % 32 == 0;
#else
  const bool avx512 = false, avx2 = false;
#endif
  const int64_t blocks = static_cast<int64_t>((bytes + kBlock - 1) / kBlock);
  workers.parallel_for(blocks, [&](int64_t b, int) {
    const size_t off = static_cast<size_t>(b) * kBlock, n = std::min(kBlock, bytes - off);
#if defined(__x86_64__)
    const uint64_t v = avx512 ? read_block_avx512(data + off, n)
                       : avx2 ? read_block_avx2(data + off, n)
                              : read_block_scalar(data + off, n);
#else
    const uint64_t v = read_block_scalar(data + off, n);
#endif
    sum.fetch_xor(v, std::memory_order_relaxed);
  });
  return sum.load();
}

}  // namespace ftjax
