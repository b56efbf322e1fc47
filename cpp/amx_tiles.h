// What the AMX kernels (kernels_amx.cc, kernels_amx8.cc) share: LDTILECFG's operand and the compiler barrier that
// publishes a buffer to the tile loads.
#pragma once
#include <cstdint>

namespace ftjax {

// GCC's LDTILECFG / TILELOADD intrinsics do not tell the compiler that they read the memory they
// point at (no "memory" clobber), so a buffer written just before one is published with this.
inline void publish(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

// LDTILECFG's 64-byte operand, palette 1: rows and bytes per row of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

}  // namespace ftjax
