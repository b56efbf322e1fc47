// XLA FFI handler for the CPU platform: cpu_experts runs the expert task list synchronously on
// the worker pool. It is the pure-CPU MoE backend and what CI exercises.
#include "ffi_cpu.h"

#include <exception>
#include <string>

#include "moe.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

ffi::Error CpuExpertsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> token_idx, ffi::Buffer<ffi::S32> expert_ids,
                          ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> n_valid,
                          ffi::Buffer<ffi::S32> unit_start, ffi::ResultBuffer<ffi::F32> y, uint64_t pool_id) {
  auto pool = find_pool(pool_id);
  if (!pool) return ffi::Error::InvalidArgument("cpu_experts: no host pool with id " + std::to_string(pool_id) +
                                                " (closed, or from another process?)");
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != pool->hidden())
    return ffi::Error::InvalidArgument("cpu_experts: x must be [T, " + std::to_string(pool->hidden()) + "]");
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (!bf16 && x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("cpu_experts: x must be float32 or bfloat16");
  const int64_t cap = static_cast<int64_t>(token_idx.element_count());
  if (static_cast<int64_t>(expert_ids.element_count()) != cap || static_cast<int64_t>(weights.element_count()) != cap)
    return ffi::Error::InvalidArgument("cpu_experts: token_idx, expert_ids and weights must have one length");
  if (static_cast<int64_t>(unit_start.element_count()) != cap)
    return ffi::Error::InvalidArgument("cpu_experts: unit_start must have the tasks' length");
  if (n_valid.element_count() != 1) return ffi::Error::InvalidArgument("cpu_experts: n_valid must be a scalar");
  const int64_t n = n_valid.typed_data()[0];
  if (n < 0 || n > cap)
    return ffi::Error::InvalidArgument("cpu_experts: n_valid " + std::to_string(n) + " outside [0, " +
                                       std::to_string(cap) + "]");
  ExpertCall call{pool.get(), x.untyped_data(), bf16, xd[0], token_idx.typed_data(), expert_ids.typed_data(),
                  weights.typed_data(), n, y->typed_data(), unit_start.typed_data()};
  try {
    run_experts(global_workers(), call, active_tier());
  } catch (const std::exception& e) {
    return ffi::Error::InvalidArgument(std::string("cpu_experts: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuExperts, CpuExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<uint64_t>("pool"));

void* cpu_experts_handler() { return reinterpret_cast<void*>(FtjaxCpuExperts); }

}  // namespace ftjax
