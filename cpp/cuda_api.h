// The nanobind face of the CUDA part: FFI capsules for platform "CUDA" and the handshake/pool
// helpers. CPU-only builds link cuda_stub.cc, which adds nothing.
#pragma once
#include <nanobind/nanobind.h>

namespace ftjax {
void add_cuda_handlers(nanobind::dict& handlers);
void bind_cuda(nanobind::module_& m);
}  // namespace ftjax
