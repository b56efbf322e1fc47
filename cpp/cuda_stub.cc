// CPU-only build: no CUDA handlers; cuda_built() is false and pinning raises.
#include <nanobind/stl/string.h>

#include <string>

#include "cuda_api.h"

namespace ftjax {
void add_cuda_handlers(nanobind::dict&) {}
void bind_cuda(nanobind::module_& m) {
  m.def("cuda_device_count", [] { return 0; });
  m.def("cuda_device_name", [](int) { return std::string(); });
}
}  // namespace ftjax
