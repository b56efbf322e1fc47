// ftjax._host: the native host runtime. This first version reports the build and the CPU's
// SIMD features; the host expert pool, worker pool, CPU expert kernels and XLA FFI handlers
// join it in the host-runtime issue.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu_features.h"

namespace nb = nanobind;

NB_MODULE(_host, m) {
  m.doc() = "ftjax native host runtime";
  m.def("cpu_features", [] {
    const auto f = ftjax::detect_cpu_features();
    nb::dict d;
    d["avx2"] = f.avx2;
    d["fma"] = f.fma;
    d["avx512f"] = f.avx512f;
    d["avx512bf16"] = f.avx512bf16;
    d["amx_bf16"] = f.amx_bf16;
    return d;
  }, "SIMD features of this CPU, from CPUID (and XCR0 for OS support).");
  m.def("cpu_brand", &ftjax::cpu_brand, "The CPU's brand string.");
  m.attr("abi_version") = 1;
}
