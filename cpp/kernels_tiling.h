// The tiling every SIMD tier shares: a tier's Tile::run<R, N> computes an R-row x N-activation
// micro-tile; dot_rows_tiled walks the rows in blocks of kRows (then single rows) and the
// activations in groups of up to kVecs, picking the micro-tile for a short last group.
// Instantiated inside each tier's file, so it is compiled with that tier's target flags.
#pragma once
#include <algorithm>

#include "kernels.h"

namespace ftjax {

template <class Tile, int R, int N>
inline void tile_upto(int n, const MatrixRef& w, int64_t r, int64_t r_end, const ActRef& a, int j0, float* out) {
  if constexpr (N > 1) {
    if (n < N) return tile_upto<Tile, R, N - 1>(n, w, r, r_end, a, j0, out);
  }
  Tile::template run<R, N>(w, r, r_end, a, j0, out);
}

template <class Tile, int kRows, int kVecs>
inline void dot_rows_tiled(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out) {
  for (int j0 = 0; j0 < a.n; j0 += kVecs) {
    const int n = std::min(kVecs, a.n - j0);
    int64_t r = r0;
    for (; r + kRows <= r1; r += kRows) tile_upto<Tile, kRows, kVecs>(n, w, r, r1, a, j0, out + (r - r0) * a.n);
    for (; r < r1; ++r) tile_upto<Tile, 1, kVecs>(n, w, r, r1, a, j0, out + (r - r0) * a.n);
  }
}

}  // namespace ftjax
