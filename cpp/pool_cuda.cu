// Pinning of the host pool (CUDA builds): cudaHostRegister after the fill, mapped so kernels
// read it zero-copy. (Allocating pinned memory and copying into it is slower: see the issue.)
#include "cuda_common.h"
#include "pool.h"

namespace ftjax {

bool cuda_built() { return true; }

void pin_pool(ExpertPool& pool) {
  if (pool.pinned()) return;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    throw std::runtime_error("cannot pin the host pool: no CUDA device is visible");
  }
  for (Bank* b : {&pool.gate_up(), &pool.down()}) {
    cuda_check(cudaHostRegister(b->data, b->alloc_bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
               ("cudaHostRegister of expert bank " + b->name).c_str());
    cuda_check(cudaHostGetDevicePointer(&b->device_ptr, b->data, 0), "cudaHostGetDevicePointer");
  }
  pool.set_pinned(true);
}

void unpin_pool(ExpertPool& pool) noexcept {
  for (Bank* b : {&pool.gate_up(), &pool.down()}) {
    if (b->device_ptr) cudaHostUnregister(b->data);
    b->device_ptr = nullptr;
  }
  pool.set_pinned(false);
}

}  // namespace ftjax
