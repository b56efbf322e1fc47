// STREAM-like read ceiling measured with the same worker threads as the expert kernels.
#pragma once
#include <cstddef>
#include <cstdint>

#include "workers.h"

namespace ftjax {
// Reads [data, data + bytes) once, split across the pool's threads by 256 KiB blocks; returns a
// checksum so the reads cannot be optimised away.
uint64_t read_all(WorkerPool& workers, const uint8_t* data, size_t bytes);
}  // namespace ftjax
