#pragma once

namespace ftjax {
void* cpu_experts_handler();  // XLA_FFI_Handler* for platform "cpu"
}
