// ftjax._host: the native host runtime. Host expert pool, worker pool, CPU expert kernels and the
// XLA FFI handlers (CPU; CUDA where built), exposed to Python with nanobind.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "cpu_features.h"
#include "cuda_api.h"
#include "ffi_cpu.h"
#include "host_plan.h"
#include "kernels.h"
#include "moe.h"
#include "pool.h"
#include "stream.h"
#include "workers.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ftjax {
namespace {

// Python owner of a registered pool: dropping it unregisters the id (a jitted call still using
// the id then fails with a clear FFI error instead of reading freed memory).
struct PoolHandle {
  std::shared_ptr<ExpertPool> pool;
  PoolHandle(int64_t n_experts, int64_t hidden, int64_t inter, const std::string& fmt, const std::string& down_layout)
      : pool(std::make_shared<ExpertPool>(n_experts, hidden, inter, parse_format(fmt), parse_down_layout(down_layout))) {
    register_pool(pool);
  }
  ~PoolHandle() { close(); }
  // Unregisters the id; the memory lives until this handle and every numpy view of it are gone.
  void close() {
    if (!closed) unregister_pool(pool->id());
    closed = true;
  }
  ExpertPool& get() { return *pool; }
  bool closed = false;
};

using F32Array = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using I32Array = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F32Vector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::ndarray<nb::numpy, float, nb::ndim<2>> run_experts_py(PoolHandle& h, nb::ndarray<nb::c_contig, nb::device::cpu> x,
                                                         I32Array token_idx, I32Array expert_ids,
                                                         nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> weights,
                                                         int64_t n_valid, bool x_bf16,
                                                         std::optional<I32Array> unit_start) {
  ExpertPool& pool = h.get();
  if (x.ndim() != 2 || static_cast<int64_t>(x.shape(1)) != pool.hidden())
    throw std::invalid_argument("x must be [T, " + std::to_string(pool.hidden()) + "]");
  const bool ok_dtype = x_bf16 ? x.dtype() == nb::dtype<uint16_t>() : x.dtype() == nb::dtype<float>();
  if (!ok_dtype) throw std::invalid_argument(x_bf16 ? "bf16 x must be passed as uint16 bits" : "x must be float32");
  const int64_t cap = static_cast<int64_t>(token_idx.shape(0));
  if (static_cast<int64_t>(expert_ids.shape(0)) != cap || static_cast<int64_t>(weights.shape(0)) != cap)
    throw std::invalid_argument("token_idx, expert_ids and weights must have one length");
  if (n_valid < 0 || n_valid > cap)
    throw std::invalid_argument("n_valid " + std::to_string(n_valid) + " outside [0, " + std::to_string(cap) + "]");
  const int64_t T = static_cast<int64_t>(x.shape(0)), H = pool.hidden();
  float* y = new float[T * H];
  nb::capsule owner(y, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  if (unit_start && static_cast<int64_t>(unit_start->shape(0)) != cap)
    throw std::invalid_argument("unit_start must have the tasks' length");
  ExpertCall call{&pool, x.data(), x_bf16, T, token_idx.data(), expert_ids.data(), weights.data(), n_valid, y,
                  unit_start ? unit_start->data() : nullptr};
  {
    nb::gil_scoped_release release;
    run_experts(global_workers(), call, active_tier());
  }
  return nb::ndarray<nb::numpy, float, nb::ndim<2>>(y, {static_cast<size_t>(T), static_cast<size_t>(H)}, owner);
}

// One expert matrix's rows times n activation vectors on the calling thread, in the active tier, with the q15 layout
// (up to int4_vnni_tokens vectors) or the pair64 order for int4 x bf16, never the AMX B-tile layout (the AMX tier
// takes its AVX-512 loops here): the kernel alone, for tests. Columns [col0, cols) only (a column window; x keeps all the columns).
nb::ndarray<nb::numpy, float, nb::ndim<2>> dot_rows_py(PoolHandle& h, const std::string& bank, int64_t expert,
                                                      nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
                                                      bool x_bf16, int64_t col0) {
  ExpertPool& pool = h.get();
  if (bank != "gate_up" && bank != "down") throw std::invalid_argument("bank is gate_up or down, got '" + bank + "'");
  const Bank& b = bank == "gate_up" ? pool.gate_up() : pool.down();
  if (expert < 0 || expert >= pool.n_experts())
    throw std::invalid_argument("expert " + std::to_string(expert) + " outside [0, " + std::to_string(pool.n_experts()) + ")");
  const bool int4 = b.format == WeightFormat::kInt4;
  const int64_t K = b.cols, n = static_cast<int64_t>(x.shape(0));
  if (col0 < 0 || col0 >= K || (int4 && col0 % 32))
    throw std::invalid_argument("col0 " + std::to_string(col0) + " is not a column of [0, " + std::to_string(K) + ")" +
                                (int4 ? " on an int4 group boundary (multiple of 32)" : ""));
  if (static_cast<int64_t>(x.shape(1)) != K || n < 1)
    throw std::invalid_argument("x must be [n >= 1, " + std::to_string(K) + "]");
  if (x_bf16 ? x.dtype() != nb::dtype<uint16_t>() : x.dtype() != nb::dtype<float>())
    throw std::invalid_argument(x_bf16 ? "bf16 x must be passed as uint16 bits" : "x must be float32");
  std::vector<float> xf(n * K);
  std::vector<uint16_t> pair;
  std::vector<int8_t> q15;
  const uint16_t* xh = x_bf16 ? static_cast<const uint16_t*>(x.data()) : nullptr;
  for (int64_t i = 0; i < n * K; ++i) xf[i] = xh ? bf16_to_f32(xh[i]) : static_cast<const float*>(x.data())[i];
  const Tier tier = active_tier();
  const bool int4_bf16 = xh && int4, q8 = int4_act_bits() == 8;
  if (int4_bf16 && reads_q15(tier) && n <= int4_vnni_limit()) {
    q15.resize(n * q15_bytes(K));
    for (int64_t j = 0; j < n; ++j) (q8 ? to_q8 : to_q15)(xh + j * K, 0, K, &q15[j * q15_bytes(K)], K / 2);
  } else if (int4_bf16 && reads_pair64(tier) && K % 64 == 0 && col0 % 64 == 0) {
    pair.resize(n * K);
    for (int64_t j = 0; j < n; ++j) to_pair64(xh + j * K, K, &pair[j * K]);
  }
  const MatrixRef w = column_window(matrix_of(b, expert), col0, K - col0);
  const ActRef a{xf.data() + col0, xh ? xh + col0 : nullptr, K, static_cast<int>(n),
                 pair.empty() ? nullptr : pair.data() + col0, nullptr, q15.empty() ? nullptr : q15.data() + col0 / 2, K / 2, q8};
  float* out = new float[b.rows * n];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  {
    nb::gil_scoped_release release;
    dot_rows_for(tier)(w, 0, b.rows, a, out);
  }
  return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, {static_cast<size_t>(b.rows), static_cast<size_t>(n)}, owner);
}

// axpy_rows (kernels.h) on one expert matrix of an f32/bf16 bank as stored, in the active tier, on the calling thread:
// out0 [n, h1 - h0] + sum over rows i in [i0, i1) of coef[j, i] * W[i, h0:h1] (kernel tests).
nb::ndarray<nb::numpy, float, nb::ndim<2>> axpy_rows_py(PoolHandle& h, const std::string& bank, int64_t expert,
                                                       nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> coef,
                                                       int64_t i0, int64_t i1, int64_t h0, int64_t h1,
                                                       nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out0) {
  ExpertPool& pool = h.get();
  if (bank != "gate_up" && bank != "down") throw std::invalid_argument("bank is gate_up or down, got '" + bank + "'");
  const Bank& b = bank == "gate_up" ? pool.gate_up() : pool.down();
  if (b.format == WeightFormat::kInt4) throw std::invalid_argument("axpy_rows takes f32 or bf16 banks, not int4");
  if (expert < 0 || expert >= pool.n_experts())
    throw std::invalid_argument("expert " + std::to_string(expert) + " outside [0, " + std::to_string(pool.n_experts()) + ")");
  if (i0 < 0 || i1 < i0 || i1 > b.rows || h0 < 0 || h1 < h0 || h1 > b.cols)
    throw std::invalid_argument("rows [" + std::to_string(i0) + ", " + std::to_string(i1) + ") or columns [" +
                                std::to_string(h0) + ", " + std::to_string(h1) + ") outside the matrix [" +
                                std::to_string(b.rows) + ", " + std::to_string(b.cols) + "]");
  const int64_t n = static_cast<int64_t>(coef.shape(0)), cols = h1 - h0;
  if (n < 1 || static_cast<int64_t>(coef.shape(1)) != b.rows)
    throw std::invalid_argument("coef must be [n >= 1, " + std::to_string(b.rows) + "]");
  if (static_cast<int64_t>(out0.shape(0)) != n || static_cast<int64_t>(out0.shape(1)) != cols)
    throw std::invalid_argument("out0 must be [" + std::to_string(n) + ", " + std::to_string(cols) + "]");
  float* out = new float[std::max<int64_t>(1, n * cols)];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  std::copy(out0.data(), out0.data() + n * cols, out);
  std::vector<const float*> c(n);
  std::vector<float*> o(n);
  for (int64_t j = 0; j < n; ++j) {
    c[j] = coef.data() + j * b.rows;
    o[j] = out + j * cols - h0;  // indexed by the absolute column
  }
  {
    nb::gil_scoped_release release;
    axpy_rows_for(active_tier())(matrix_of(b, expert), i0, i1, c.data(), static_cast<int>(n), h0, h1, o.data());
  }
  return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, {static_cast<size_t>(n), static_cast<size_t>(cols)}, owner);
}

// The q15 layout (kernels.h) of one bf16 vector, as its bytes: the layout alone, for tests.
nb::ndarray<nb::numpy, int8_t, nb::ndim<1>> q15_layout_py(nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> x,
                                                          int bits) {
  if (bits != 15 && bits != 8) throw std::invalid_argument("bits is 15 or 8, got " + std::to_string(bits));
  const int64_t K = static_cast<int64_t>(x.shape(0));
  if (K % 8 || K == 0) throw std::invalid_argument("the q15 layout takes whole lanes of 8 columns, got " + std::to_string(K));
  int8_t* out = new int8_t[q15_bytes(K)];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<int8_t*>(p); });
  (bits == 8 ? to_q8 : to_q15)(x.data(), 0, K, out, K / 2);
  return nb::ndarray<nb::numpy, int8_t, nb::ndim<1>>(out, {static_cast<size_t>(q15_bytes(K))}, owner);
}

nb::dict worker_info() {
  const WorkerPool& w = global_workers();
  nb::dict d;
  d["n_threads"] = w.n_threads();
  d["n_workers"] = w.config().n_workers;
  d["spin_us"] = w.config().spin_us;
  d["pin"] = w.config().pin;
  d["pinned_cpus"] = w.pinned_cpus();
  d["physical_cores"] = physical_core_cpus().size();
  return d;
}

// Seconds to read the whole buffer once (best of reps) with the expert kernels' worker threads, or (threads > 0)
// with a pool of its own of that many threads, the caller and threads - 1 workers pinned over every logical CPU
// (the host's all-thread read: the decode roofline's DRAM bandwidth).
double stream_read_seconds(nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> buf, int reps,
                           int threads) {
  if (reps < 1) throw std::invalid_argument("reps must be >= 1, got " + std::to_string(reps));
  if (threads < 0 || threads > 1024)
    throw std::invalid_argument("threads must be 0 (the worker pool) or 1..1024, got " + std::to_string(threads));
  nb::gil_scoped_release release;
  std::unique_ptr<WorkerPool> own;
  if (threads > 0) {
    WorkerConfig cfg;
    cfg.n_workers = threads - 1;
    cfg.every_cpu = true;
    own = std::make_unique<WorkerPool>(cfg);
  }
  WorkerPool& pool = own ? *own : global_workers();
  double best = 1e30;
  volatile uint64_t sink = 0;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    sink = sink ^ read_all(pool, buf.data(), buf.shape(0));
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace
}  // namespace ftjax

namespace {
// An expert call's rounds, as the profile dicts name them.
constexpr const char* kRoundNames[3] = {"layouts", "phase1", "phase2"};
void put_call_times(nb::dict& d, double total_us, double setup_us, const double (&round_us)[3],
                    const double (&wait_us)[3]) {
  d["total_us"] = total_us;
  d["setup_us"] = setup_us;
  for (int k = 0; k < 3; ++k) {
    d[(std::string(kRoundNames[k]) + "_us").c_str()] = round_us[k];
    d[(std::string(kRoundNames[k]) + "_wait_us").c_str()] = wait_us[k];
  }
}
}  // namespace

NB_MODULE(_host, m) {
  // Pools, channels and the coordinator live until the process ends (JAX holds the FFI capsules and
  // executables referring to them), so nanobind's exit-time leak report would only print noise on
  // every run of the CLI.
  nb::set_leak_warnings(false);
  using namespace ftjax;
  m.doc() = "ftjax native host runtime";
  m.def("cpu_features", [] {
    const auto f = detect_cpu_features();
    nb::dict d;
    d["avx2"] = f.avx2;
    d["fma"] = f.fma;
    d["avx512f"] = f.avx512f;
    d["avx512bw"] = f.avx512bw;
    d["avx512vl"] = f.avx512vl;
    d["avx512bf16"] = f.avx512bf16;
    d["avx512vnni"] = f.avx512vnni;
    d["amx_bf16"] = f.amx_bf16;
    d["amx_tile"] = f.amx_tile;
    return d;
  }, "SIMD features of this CPU, from CPUID (and XCR0 for OS support).");
  m.def("cpu_brand", &cpu_brand, "The CPU's brand string.");
  m.attr("abi_version") = 2;

  nb::class_<PoolHandle>(m, "HostPool")
      .def(nb::init<int64_t, int64_t, int64_t, const std::string&, const std::string&>(), "n_experts"_a, "hidden"_a,
           "inter"_a, "format"_a = "bf16", "down_layout"_a = "hi")
      .def_prop_ro("id", [](PoolHandle& h) { return h.get().id(); })
      .def_prop_ro("n_experts", [](PoolHandle& h) { return h.get().n_experts(); })
      .def_prop_ro("hidden", [](PoolHandle& h) { return h.get().hidden(); })
      .def_prop_ro("inter", [](PoolHandle& h) { return h.get().inter(); })
      .def_prop_ro("format", [](PoolHandle& h) { return std::string(format_name(h.get().format())); })
      .def_prop_ro("down_layout", [](PoolHandle& h) { return std::string(down_layout_name(h.get().down_layout())); })
      .def_prop_ro("total_bytes", [](PoolHandle& h) { return h.get().total_bytes(); })
      .def_prop_ro("pinned", [](PoolHandle& h) { return h.get().pinned(); })
      .def_prop_ro("closed", [](PoolHandle& h) { return h.closed; })
      .def("expert_bytes", [](PoolHandle& h, const std::string& bank) { return h.get().bank(bank).expert_bytes; })
      .def("address", [](PoolHandle& h, const std::string& bank) {
        return reinterpret_cast<uintptr_t>(h.get().bank(bank).data);
      })
      .def("bank", [](PoolHandle& h, const std::string& name) {
        Bank& b = h.get().bank(name);
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(
            b.data, {static_cast<size_t>(h.get().n_experts()), b.expert_bytes}, nb::handle());
      }, nb::rv_policy::reference_internal, "Writable uint8 view [n_experts, expert_bytes] of a bank.")
      .def("pin", [](PoolHandle& h) {
        nb::gil_scoped_release release;
        pin_pool(h.get());
      }, "Register the filled banks as pinned, device-mapped memory (CUDA builds with a GPU).")
      .def("close", &PoolHandle::close);

  m.def("run_experts", &run_experts_py, "pool"_a, "x"_a, "token_idx"_a, "expert_ids"_a, "weights"_a,
        "n_valid"_a, "x_bf16"_a = false, "unit_start"_a = nb::none(),
        "The CPU expert kernel outside JAX (tests, benchmarks). unit_start [tasks] (optional): each task "
        "computes only its expert's intermediate units [u, I).");
  m.def("dot_rows", &dot_rows_py, "pool"_a, "bank"_a, "expert"_a, "x"_a, "x_bf16"_a = false, "col0"_a = 0,
        "One expert matrix's rows [rows, n] times x [n, cols] (columns [col0, cols)) on the calling thread, in the "
        "active tier (kernel tests).");
  m.def("axpy_rows", &axpy_rows_py, "pool"_a, "bank"_a, "expert"_a, "coef"_a, "i0"_a, "i1"_a, "h0"_a, "h1"_a, "out0"_a,
        "out0 + coef[:, i0:i1] @ W[i0:i1, h0:h1] for one f32/bf16 expert matrix as stored, in the active tier (kernel "
        "tests of the transposed down's pass).");
  m.def("q15_layout", &q15_layout_py, "x"_a, "bits"_a = 15,
        "The q15 activation layout of a bf16 vector (uint16 bits), or its q8 form (bits=8), as bytes (tests).");
  m.def("available_tiers", [] {
    std::vector<std::string> out;
    for (Tier t : available_tiers()) out.push_back(tier_name(t));
    return out;
  });
  m.def("active_tier", [] { return std::string(tier_name(active_tier())); });
  m.def("last_expert_call", [] {
    const ExpertCallProfile p = last_expert_call_profile();
    nb::dict d;
    put_call_times(d, p.total_us, p.setup_us, p.round_us, p.wait_us);
    for (int k = 0; k < 3; ++k) d[(std::string(kRoundNames[k]) + "_items").c_str()] = p.items[k];
    d["routes"] = p.routes;
    d["groups"] = p.groups;
    d["rows1"] = p.rows1;
    d["rows2"] = p.rows2;
    d["weight_bytes"] = p.weight_bytes;
    return d;
  }, "Where the last CPU expert call spent its time (us): setup, then per round (layouts, phase1 = "
     "gate/up, phase2 = down) its wall time and the caller's wait for the other threads; the expert "
     "weight bytes it read.");
  m.def("expert_call_totals", [] {
    const ExpertCallTotals t = expert_call_totals();
    nb::dict d;
    d["calls"] = t.calls;
    d["weight_bytes"] = t.weight_bytes;
    put_call_times(d, t.total_us, t.setup_us, t.round_us, t.wait_us);
    return d;
  }, "Every CPU expert call with tasks since start-up: how many (calls), the weight bytes they read, and "
     "last_expert_call's times (us) summed.");
  m.def("amx_route_counts", [] {
    const std::vector<int64_t> c = amx_route_counts();
    nb::dict d;
    d["avx512"] = c[static_cast<int>(AmxRoute::kAvx512)];
    d["bf16"] = c[static_cast<int>(AmxRoute::kBf16)];
    d["int4"] = c[static_cast<int>(AmxRoute::kInt4)];
    return d;
  }, "dot_rows calls the AMX tier ran on its AVX-512 loops, its bf16 tile path and its int4 tile path, "
     "since the process started.");
  m.def("set_tier", &set_tier, "name"_a);
  m.def("prefetch_bytes", [] { return prefetch_bytes(); },
        "How far ahead (bytes) the AVX-512 and AMX tiers prefetch weight rows longer than short_row_bytes.");
  m.def("set_prefetch_bytes", &set_prefetch_bytes, "bytes"_a, "Set the prefetch distance (0 = off).");
  m.def("gate_up_item_rows", &gate_up_item_rows,
        "Gate rows (and as many up rows) per work item of a CPU expert call (before balance).");
  m.def("set_gate_up_item_rows", &set_gate_up_item_rows, "rows"_a,
        "Set gate/up's rows per work item (a power of two in [4, 1024]); only speed depends on it.");
  m.def("down_item_rows", &down_item_rows, "Output rows of down per work item of a CPU expert call (before balance).");
  m.def("set_down_item_rows", &set_down_item_rows, "rows"_a,
        "Set down's rows per work item (a power of two in [4, 1024]); only speed depends on it.");
  m.def("short_row_bytes", &short_row_bytes, "Rows up to this many bytes prefetch a micro-tile ahead (0 = never).");
  m.def("set_short_row_bytes", &set_short_row_bytes, "bytes"_a, "Set the short-row limit (0 = off).");
  m.def("window_prefetch", &window_prefetch,
        "Whether a column window's rows stop their prefetch at the window's end (default True).");
  m.def("set_window_prefetch", &set_window_prefetch, "on"_a,
        "False: a column window's rows prefetch past its end as whole rows do (the earlier kernels).");
  m.def("tile_prefetch", &tile_prefetch,
        "Whether long rows prefetch the next tile's rows in the last prefetch distance of their window (default False).");
  m.def("set_tile_prefetch", &set_tile_prefetch, "on"_a,
        "True: a tile of long rows warms the next tile's rows as it ends (bench/unit_windows.py, decode --knob-variants).");
  m.def("down_sum", &down_sum, "Whether down's round sums a token's lone experts in one pass (default False).");
  m.def("set_down_sum", &set_down_sum, "on"_a,
        "True: a token's lone experts' down rows summed in one pass per work item (False: one call each).");
  m.def("int4_act_bits", &int4_act_bits,
        "15: int4 x bf16 on the VNNI loop with exact 15-bit activations (default); 8: int8 activations (lossy, "
        "faster).");
  m.def("set_int4_act_bits", &set_int4_act_bits, "bits"_a, "Set it (15 or 8).");
  m.def("int4_q8_tokens", &int4_q8_tokens,
        "With int4_act_bits 8: up to how many tokens per expert int4 x bf16 calls take the VNNI loop.");
  m.def("set_int4_q8_tokens", &set_int4_q8_tokens, "tokens"_a, "Set it (0 .. 64).");
  m.def("int4_vnni_tokens", &int4_vnni_tokens,
        "Up to how many tokens per expert int4 x bf16 calls on the AVX-512 loops use q15 activations and VPDPBUSD.");
  m.def("set_int4_vnni_tokens", &set_int4_vnni_tokens, "tokens"_a,
        "Set it (0 .. 64; 0: always the bf16 products, VDPBF16PS, the earlier loop).");
  m.def("configure_workers", [](int n_workers, int spin_us, bool pin) {
    if (spin_us < 0) throw std::invalid_argument("spin_us must be >= 0, got " + std::to_string(spin_us));
    configure_global_workers(WorkerConfig{n_workers, spin_us, pin});
  }, "n_workers"_a = -1, "spin_us"_a = 100, "pin"_a = true);
  m.def("worker_info", &worker_info);
  m.def("worker_self_test", [](int rounds, int64_t max_items, uint64_t seed, bool big) {
    if (rounds < 0 || max_items < 1) throw std::invalid_argument("need rounds >= 0 and max_items >= 1");
    nb::gil_scoped_release release;
    return worker_self_test(global_workers(), rounds, max_items, seed, big);
  }, "rounds"_a, "max_items"_a, "seed"_a = 0, "big"_a = false,
        "Test hook: random parallel_for rounds; returns the number of anomalies (0 = correct).");
  m.def("stream_read_seconds", &stream_read_seconds, "buf"_a, "reps"_a = 3, "threads"_a = 0);

  m.def("host_plan_tasks", [](int64_t tokens, int64_t top_k, const nb::dict& statics, I32Array ids, I32Array valid,
                              F32Vector gate, I32Array slot, I32Array recency, I32Array slot_lu, int32_t step,
                              int32_t below, float fill_fraction) {
    const int64_t R = tokens * top_k;
    if (static_cast<int64_t>(ids.size()) != R || static_cast<int64_t>(gate.size()) != R ||
        static_cast<int64_t>(slot.size()) != R || static_cast<int64_t>(recency.size()) != R ||
        static_cast<int64_t>(slot_lu.size()) != R || static_cast<int64_t>(valid.size()) != tokens)
      throw std::invalid_argument("host_plan_tasks: the per-route arrays must have tokens * top_k entries, valid tokens");
    int32_t plan[kPlanStatics];
    for (int i = 0; i < kPlanStatics; ++i) {
      if (!statics.contains(kPlanStaticNames[i]))
        throw std::invalid_argument(std::string("host_plan_tasks: statics has no '") + kPlanStaticNames[i] + "'");
      plan[i] = nb::cast<int32_t>(statics[kPlanStaticNames[i]]);
    }
    HostPlanInputs in;
    in.ids = ids.data();
    in.valid = valid.data();
    in.gate = gate.data();
    in.slot = slot.data();
    in.recency = recency.data();
    in.slot_lu = slot_lu.data();
    in.step = step;
    in.below = below;
    in.fill_fraction = fill_fraction;
    HostPlanTasks t;
    host_plan_tasks(host_plan_statics(tokens, top_k, plan), in, &t);
    return nb::make_tuple(t.token, t.flat, t.units, t.weight, t.checksum);
  }, "tokens"_a, "top_k"_a, "statics"_a, "ids"_a, "valid"_a, "gate"_a, "slot"_a, "recency"_a, "slot_lu"_a, "step"_a,
        "below"_a, "fill_fraction"_a,
        "The host plan's CPU task list (cpp/host_plan.h) from what the GPU gathers, under the plan's statics "
        "(plan_fused.plan_statics): (token, flat, units, weight, checksum).");
  m.def("task_checksum", [](int32_t token, int32_t flat, int32_t unit, float weight) {
    uint32_t wb;
    std::memcpy(&wb, &weight, 4);
    return task_checksum(token, flat, unit, wb);
  }, "token"_a, "flat"_a, "unit"_a, "weight"_a, "One task's share of the host plan's checksum.");
  m.def("cuda_built", &cuda_built);
  m.def("ffi_handlers", [] {
    nb::dict cpu, cuda;
    cpu["ftjax_cpu_experts"] = nb::capsule(cpu_experts_handler());
    cpu["ftjax_plan_layer"] = nb::capsule(plan_cpu_handler());
    add_cuda_handlers(cuda);
    nb::dict d;
    d["cpu"] = cpu;
    d["CUDA"] = cuda;
    return d;
  }, "XLA FFI handler capsules by platform.");
  bind_cuda(m);
}
