// Host expert pool: one aligned allocation per expert bank, [n_experts, expert_bytes], flat id
// l*E + e. Filled once (by the FTW loader through numpy views), optionally pinned and
// device-mapped after the fill, never written afterwards.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ftjax {

enum class WeightFormat : int { kF32 = 0, kBF16 = 1, kInt4 = 2 };

WeightFormat parse_format(const std::string& name);  // "f32" | "bf16" | "int4"; throws otherwise
const char* format_name(WeightFormat f);

// Bytes of one expert's [rows, cols] matrix. int4: packed nibbles [rows, cols/2] (low nibble =
// even column) followed by bf16 scales [rows, cols/32]; value = (q - 8) * scale.
size_t matrix_bytes(WeightFormat f, int64_t rows, int64_t cols);

struct Bank {
  std::string name;
  WeightFormat format;
  int64_t rows = 0, cols = 0;     // per expert as stored: torch [out, in], except a transposed down ([I, H])
  size_t expert_bytes = 0;        // one row of the bank
  uint8_t* data = nullptr;        // 2 MiB aligned
  size_t alloc_bytes = 0;         // mapped length (multiple of 2 MiB)
  void* device_ptr = nullptr;     // set once pinned + mapped (CUDA builds)
  const uint8_t* expert(int64_t id) const { return data + static_cast<size_t>(id) * expert_bytes; }
};

class ExpertPool;
uint64_t register_pool(std::shared_ptr<ExpertPool> pool);

// How the down bank stores an expert's [H, I] matrix: as it is (kHI, torch's [out, in]) or transposed (kIH: [I, H],
// unit i's down column as row i), so that the unit split's CPU window [u, I) of an expert is I - u whole rows of
// every matrix it reads and its gate/up and down rows can be read in one pass (moe.cc). f32/bf16 pools only (an int4
// down's groups of 32 run along I). The GPU cache's slots keep [H, I] either way: the fills transpose (CUDA builds).
enum class DownLayout : int { kHI = 0, kIH = 1 };
DownLayout parse_down_layout(const std::string& name);  // "hi" | "ih"; throws otherwise
const char* down_layout_name(DownLayout d);

// The routed-expert pool of one model: banks gate_up [N, 2I, H] and down [N, H, I] (or [N, I, H]: DownLayout).
class ExpertPool {
 public:
  ExpertPool(int64_t n_experts, int64_t hidden, int64_t inter, WeightFormat format,
             DownLayout down_layout = DownLayout::kHI);
  ~ExpertPool();
  ExpertPool(const ExpertPool&) = delete;
  ExpertPool& operator=(const ExpertPool&) = delete;

  uint64_t id() const { return id_; }
  int64_t n_experts() const { return n_experts_; }
  int64_t hidden() const { return hidden_; }
  int64_t inter() const { return inter_; }
  WeightFormat format() const { return format_; }
  DownLayout down_layout() const { return down_layout_; }
  bool down_transposed() const { return down_layout_ == DownLayout::kIH; }
  Bank& gate_up() { return banks_[0]; }
  Bank& down() { return banks_[1]; }
  const Bank& gate_up() const { return banks_[0]; }
  const Bank& down() const { return banks_[1]; }
  Bank& bank(const std::string& name);  // throws std::out_of_range naming the valid banks
  size_t total_bytes() const;
  bool pinned() const { return pinned_; }
  void set_pinned(bool p) { pinned_ = p; }

 private:
  friend uint64_t register_pool(std::shared_ptr<ExpertPool> pool);
  uint64_t id_;
  int64_t n_experts_, hidden_, inter_;
  WeightFormat format_;
  DownLayout down_layout_;
  Bank banks_[2];
  bool pinned_ = false;
};

// Process-wide registry: FFI handlers find a pool by the u64 id passed as an attribute.
uint64_t register_pool(std::shared_ptr<ExpertPool> pool);
void unregister_pool(uint64_t id);
std::shared_ptr<ExpertPool> find_pool(uint64_t id);  // nullptr if absent

// Pinning hooks, implemented by the CUDA part when it is built (pool_cuda.cu); else they throw.
bool cuda_built();
void pin_pool(ExpertPool& pool);
void unpin_pool(ExpertPool& pool) noexcept;

}  // namespace ftjax
