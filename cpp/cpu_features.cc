#include "cpu_features.h"

#include <cstring>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace ftjax {

#if defined(__x86_64__) || defined(_M_X64)
namespace {
bool os_saves_avx512_state() {
  // XCR0 bits 1,2 (SSE/AVX) and 5,6,7 (opmask, ZMM) must be enabled by the OS.
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (eax & 0xE6) == 0xE6;
}
bool os_saves_amx_state() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (eax & 0x60000) == 0x60000;
}
bool os_saves_avx_state() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (eax & 0x6) == 0x6;
}
}  // namespace

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  if (!osxsave || !os_saves_avx_state()) return f;
  f.fma = c & (1u << 12);
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = b & (1u << 5);
  const bool zmm = os_saves_avx512_state();
  f.avx512f = zmm && (b & (1u << 16));
  f.avx512bw = f.avx512f && (b & (1u << 30));
  f.avx512vl = f.avx512f && (b & (1u << 31));
  f.avx512vnni = f.avx512f && (c & (1u << 11));
  // AMX also needs the OS to enable tile state (XCR0 bits 17, 18) and to grant it to this
  // process (arch_prctl ARCH_REQ_XCOMP_PERM, done by the AMX kernel before first use).
  f.amx_bf16 = (d & (1u << 22)) && os_saves_amx_state();
  f.amx_tile = (d & (1u << 24)) && os_saves_amx_state();
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512bf16 = f.avx512f && (a & (1u << 5));
  return f;
}

std::string cpu_brand() {
  unsigned regs[12];
  if (__get_cpuid_max(0x80000000, nullptr) < 0x80000004) return "unknown";
  for (unsigned i = 0; i < 3; ++i)
    __get_cpuid(0x80000002 + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2], &regs[4 * i + 3]);
  char brand[49];
  std::memcpy(brand, regs, 48);
  brand[48] = 0;
  std::string s(brand);
  const auto start = s.find_first_not_of(' ');
  return start == std::string::npos ? "unknown" : s.substr(start);
}
#else
CpuFeatures detect_cpu_features() { return {}; }
std::string cpu_brand() { return "unknown"; }
#endif

}  // namespace ftjax
