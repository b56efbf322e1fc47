// nanobind glue of the CUDA part: FFI capsules, channels, device queries and the timing helpers
// used by calibration and the benchmarks (CUDA events; outside XLA).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda_api.h"
#include "cuda_common.h"
#include "ffi_cuda.h"
#include "pool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ftjax {
namespace {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: report 0, never raise at import
    return 0;
  }
  return n;
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t n) { cuda_check(cudaMalloc(&p, n ? n : 1), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(p); }
};

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    cuda_check(cudaEventCreateWithFlags(&a, cudaEventBlockingSync), "cudaEventCreate");
    cuda_check(cudaEventCreateWithFlags(&b, cudaEventBlockingSync), "cudaEventCreate");
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  double seconds() {
    cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    return ms / 1e3;
  }
};

// Median-free simple timing: total seconds of `reps` fills of the same list (after one warm-up).
double fill_seconds(uint64_t pool_id, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> ids,
                    nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> slots, int64_t n_slots, int reps,
                    int64_t blocks) {
  auto pool = find_pool(pool_id);
  if (!pool) throw std::invalid_argument("no host pool with id " + std::to_string(pool_id));
  const int64_t q = static_cast<int64_t>(ids.shape(0));
  if (static_cast<int64_t>(slots.shape(0)) != q) throw std::invalid_argument("ids and slots differ in length");
  std::vector<int32_t> host(2 * q + 1);
  std::copy(ids.data(), ids.data() + q, host.begin());
  std::copy(slots.data(), slots.data() + q, host.begin() + q);
  host[2 * q] = static_cast<int32_t>(q);
  nb::gil_scoped_release release;
  DeviceBuffer lists(host.size() * 4), c0(n_slots * pool->gate_up().expert_bytes),
      c1(n_slots * pool->down().expert_bytes);
  cuda_check(cudaMemcpy(lists.p, host.data(), host.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  cudaStream_t s;
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const int32_t* d = static_cast<const int32_t*>(lists.p);
  launch_fill(s, *pool, d, d + q, d + 2 * q, q, n_slots, c0.p, c1.p, blocks);
  Timer t;
  cudaEventRecord(t.a, s);
  for (int i = 0; i < reps; ++i) launch_fill(s, *pool, d, d + q, d + 2 * q, q, n_slots, c0.p, c1.p, blocks);
  cudaEventRecord(t.b, s);
  const double sec = t.seconds();
  cudaStreamDestroy(s);
  return sec;
}

// Pinned host -> device cudaMemcpy of `nbytes`, `reps` times: the PCIe ceiling for the fill.
double memcpy_h2d_seconds(size_t nbytes, int reps) {
  nb::gil_scoped_release release;
  void* host = nullptr;
  cuda_check(cudaHostAlloc(&host, nbytes, cudaHostAllocPortable), "cudaHostAlloc");
  std::memset(host, 1, nbytes);
  DeviceBuffer dev(nbytes);
  cudaStream_t s;
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaMemcpyAsync(dev.p, host, nbytes, cudaMemcpyHostToDevice, s);
  Timer t;
  cudaEventRecord(t.a, s);
  for (int i = 0; i < reps; ++i) cudaMemcpyAsync(dev.p, host, nbytes, cudaMemcpyHostToDevice, s);
  cudaEventRecord(t.b, s);
  const double sec = t.seconds();
  cudaStreamDestroy(s);
  cudaFreeHost(host);
  return sec;
}

}  // namespace

void add_cuda_handlers(nb::dict& h) {
  h["ftjax_expert_fill"] = nb::capsule(expert_fill_handler(true));
  h["ftjax_expert_fill_nocb"] = nb::capsule(expert_fill_handler(false));
  h["ftjax_expert_fill_units"] = nb::capsule(expert_fill_units_handler(true));
  h["ftjax_expert_fill_units_nocb"] = nb::capsule(expert_fill_units_handler(false));
  h["ftjax_expert_fill_beside"] = nb::capsule(expert_fill_beside_handler());
  h["ftjax_cpu_experts_submit"] = nb::capsule(cpu_submit_handler(true));
  h["ftjax_cpu_experts_submit_nocb"] = nb::capsule(cpu_submit_handler(false));
  h["ftjax_cpu_experts_collect"] = nb::capsule(cpu_collect_handler(true));
  h["ftjax_cpu_experts_collect_nocb"] = nb::capsule(cpu_collect_handler(false));
  h["ftjax_cpu_experts_publish"] = nb::capsule(cpu_publish_handler());
  h["ftjax_cpu_experts_collect_checked"] = nb::capsule(cpu_collect_checked_handler());
  h["ftjax_expert_fill_fork_nocb"] = nb::capsule(expert_fill_fork_handler());
  h["ftjax_stream_join_nocb"] = nb::capsule(stream_join_handler());
  h["ftjax_bg_wait"] = nb::capsule(bg_wait_handler());
  h["ftjax_bg_fork_nocb"] = nb::capsule(bg_fork_handler());
  h["ftjax_plan_layer"] = nb::capsule(plan_cuda_handler());
  h["ftjax_route_tables"] = nb::capsule(route_tables_handler());
#ifdef FTJAX_WITH_SM90A
  h["ftjax_prefill_gate_up"] = nb::capsule(prefill_gate_up_handler());
#endif
}

void bind_cuda(nb::module_& m) {
  m.def("cuda_device_count", &device_count);
  m.def("cuda_device_name", [](int dev) {
    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
    return std::string(prop.name);
  }, "device"_a = 0);
  m.def("create_channel", &create_channel, "channel"_a, "pool_id"_a, "max_tokens"_a, "max_tasks"_a);
  m.def("destroy_channel", [](int64_t channel) {
    nb::gil_scoped_release release;
    destroy_channel(channel);
  }, "channel"_a);
  m.def("live_channels", &live_channels);
  m.def("channel_error", &channel_error, "channel"_a);
  m.def("channel_jobs", &channel_jobs, "channel"_a);
  m.def("channel_serve_seconds", &channel_serve_seconds, "channel"_a);
  m.def("channel_stamps", [](int64_t channel, nb::ndarray<int64_t, nb::shape<kStampRing, kStFields>, nb::c_contig> gpu,
                             nb::ndarray<int64_t, nb::shape<kStampRing, kHostStampFields>, nb::c_contig> host) {
    const StampCounts c = channel_stamps(channel, gpu.data(), host.data());
    return nb::make_tuple(c.submits, c.collects, c.served);
  }, "channel"_a, "gpu"_a, "host"_a);
  m.attr("STAMP_RING") = kStampRing;
  m.attr("STAMP_FIELDS") = static_cast<int>(kStFields);
  m.attr("HOST_STAMP_FIELDS") = static_cast<int>(kHostStampFields);
  m.def("fill_seconds", &fill_seconds, "pool_id"_a, "ids"_a, "slots"_a, "n_slots"_a, "reps"_a = 10, "blocks"_a = 0);
  m.def("memcpy_h2d_seconds", &memcpy_h2d_seconds, "nbytes"_a, "reps"_a = 10);
  m.def("prepare_fill_beside", &prepare_fill_beside);
  m.def("create_background", &create_background, "layers"_a, "max_fill"_a);
  m.def("background_error", &background_error, "id"_a);
  m.def("clear_background_error", &clear_background_error, "id"_a);
  m.def("set_background_yield", &set_background_yield, "id"_a, "mask"_a);
  m.def("background_yield", &background_yield, "id"_a);
  m.def("transfer_word", &transfer_word, "word"_a);
  m.def("add_transfer_word", &add_transfer_word, "word"_a, "delta"_a);
  m.def("destroy_background", [](int64_t id) {
    nb::gil_scoped_release release;
    destroy_background(id);
  }, "id"_a);
  m.def("live_backgrounds", &live_backgrounds);
  m.def("sync_side_stream", []() {
    nb::gil_scoped_release release;
    sync_side_stream();
  });
}

}  // namespace ftjax
