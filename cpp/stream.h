// STREAM-like read ceiling measured with the same worker threads as the expert kernels.
#pragma once
#include <cstddef>
#include <cstdint>

#include "workers.h"

namespace ftjax {
// Reads [data, data + bytes) once, split across the pool's threads by 2 MiB blocks (64-byte loads where the CPU
// has AVX-512, else 32-byte, else scalar; all for a buffer aligned to the load); returns a
// checksum so the reads cannot be optimised away.
uint64_t read_all(WorkerPool& workers, const uint8_t* data, size_t bytes);
}  // namespace ftjax
