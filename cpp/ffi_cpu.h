#pragma once

namespace ftjax {
void* cpu_experts_handler();  // XLA_FFI_Handler* for platform "cpu"
void* plan_cpu_handler();     // the fused plan of one MoE layer call (plan_cpu.cc)
}
