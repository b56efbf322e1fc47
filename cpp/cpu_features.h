// CPU feature detection (CPUID) for run-time dispatch of the CPU expert kernels.
#pragma once
#include <string>

namespace ftjax {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
  bool avx512vnni = false;
  bool amx_bf16 = false;
  bool amx_tile = false;
};

CpuFeatures detect_cpu_features();
std::string cpu_brand();

}  // namespace ftjax
