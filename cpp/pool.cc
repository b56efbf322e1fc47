#include "pool.h"

#include <sys/mman.h>

#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_map>

namespace ftjax {
namespace {
constexpr size_t kAlign = size_t{2} << 20;  // huge-page boundary: THP can back the whole bank

std::mutex g_registry_mu;
std::unordered_map<uint64_t, std::shared_ptr<ExpertPool>> g_registry;
uint64_t g_next_id = 1;

uint8_t* map_aligned(size_t bytes, size_t* mapped) {
  // Anonymous mmap is lazily zeroed by the kernel: the loader's reads are the first touch, so
  // there is no separate zero-fill pass over tens of GB.
  const size_t len = (bytes + kAlign - 1) / kAlign * kAlign + kAlign;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (base + kAlign - 1) / kAlign * kAlign;
  // Give back the unaligned head and the tail so that [aligned, aligned + body) is all we keep.
  const size_t body = len - kAlign;
  if (aligned > base) munmap(p, aligned - base);
  const uintptr_t end = aligned + body, map_end = base + len;
  if (map_end > end) munmap(reinterpret_cast<void*>(end), map_end - end);
#ifdef MADV_HUGEPAGE
  madvise(reinterpret_cast<void*>(aligned), body, MADV_HUGEPAGE);  // best effort
#endif
  *mapped = body;
  return reinterpret_cast<uint8_t*>(aligned);
}
}  // namespace

WeightFormat parse_format(const std::string& name) {
  if (name == "f32" || name == "float32" || name == "fp32") return WeightFormat::kF32;
  if (name == "bf16" || name == "bfloat16") return WeightFormat::kBF16;
  if (name == "int4") return WeightFormat::kInt4;
  throw std::invalid_argument("weight format '" + name + "' unknown; valid: f32, bf16, int4");
}

const char* format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return "f32";
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kInt4: return "int4";
  }
  return "?";
}

DownLayout parse_down_layout(const std::string& name) {
  if (name == "hi") return DownLayout::kHI;
  if (name == "ih") return DownLayout::kIH;
  throw std::invalid_argument("down layout '" + name + "' unknown; valid: hi ([H, I], as torch), ih ([I, H])");
}

const char* down_layout_name(DownLayout d) { return d == DownLayout::kIH ? "ih" : "hi"; }

size_t matrix_bytes(WeightFormat f, int64_t rows, int64_t cols) {
  const size_t r = static_cast<size_t>(rows), c = static_cast<size_t>(cols);
  switch (f) {
    case WeightFormat::kF32: return r * c * 4;
    case WeightFormat::kBF16: return r * c * 2;
    case WeightFormat::kInt4: return r * c / 2 + r * (c / 32) * 2;
  }
  return 0;
}

ExpertPool::ExpertPool(int64_t n_experts, int64_t hidden, int64_t inter, WeightFormat format, DownLayout down_layout)
    : id_(0), n_experts_(n_experts), hidden_(hidden), inter_(inter), format_(format), down_layout_(down_layout) {
  if (n_experts < 1 || hidden < 1 || inter < 1)
    throw std::invalid_argument("expert pool needs n_experts, hidden, inter >= 1; got " +
                                std::to_string(n_experts) + ", " + std::to_string(hidden) + ", " +
                                std::to_string(inter));
  if (format == WeightFormat::kInt4 && (hidden % 32 || inter % 32))
    throw std::invalid_argument("int4 experts need hidden and inter divisible by 32 (group size); got " +
                                std::to_string(hidden) + ", " + std::to_string(inter));
  if (format == WeightFormat::kInt4 && down_layout == DownLayout::kIH)
    throw std::invalid_argument("int4 experts keep down as [H, I] (its groups of 32 run along I): down layout 'ih' "
                                "needs an f32 or bf16 pool");
  banks_[0] = Bank{"gate_up", format, 2 * inter, hidden};
  banks_[1] = down_layout == DownLayout::kIH ? Bank{"down", format, inter, hidden} : Bank{"down", format, hidden, inter};
  for (auto& b : banks_) {
    b.expert_bytes = matrix_bytes(format, b.rows, b.cols);
    b.data = map_aligned(b.expert_bytes * static_cast<size_t>(n_experts), &b.alloc_bytes);
  }
}

ExpertPool::~ExpertPool() {
  if (pinned_) unpin_pool(*this);
  for (auto& b : banks_)
    if (b.data) munmap(b.data, b.alloc_bytes);
}

Bank& ExpertPool::bank(const std::string& name) {
  for (auto& b : banks_)
    if (b.name == name) return b;
  throw std::out_of_range("expert bank '" + name + "' unknown; valid: gate_up, down");
}

size_t ExpertPool::total_bytes() const {
  return (banks_[0].expert_bytes + banks_[1].expert_bytes) * static_cast<size_t>(n_experts_);
}

uint64_t register_pool(std::shared_ptr<ExpertPool> pool) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  const uint64_t id = g_next_id++;
  pool->id_ = id;  // set once, before any other thread can see the pool
  g_registry[id] = std::move(pool);
  return id;
}

void unregister_pool(uint64_t id) {
  std::shared_ptr<ExpertPool> keep;  // destroy outside the lock (munmap / unpin can be slow)
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto it = g_registry.find(id);
    if (it == g_registry.end()) return;
    keep = std::move(it->second);
    g_registry.erase(it);
  }
}

std::shared_ptr<ExpertPool> find_pool(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  return it == g_registry.end() ? nullptr : it->second;
}

#ifndef FTJAX_WITH_CUDA
bool cuda_built() { return false; }
void pin_pool(ExpertPool&) {
  throw std::runtime_error("ftjax._host was built without CUDA: the pool cannot be pinned");
}
void unpin_pool(ExpertPool&) noexcept {}
#endif

}  // namespace ftjax
