// The axpy loop of a transposed down bank (axpy_rows in kernels.h) that the SIMD tiers share: rows in steps of R = 4,
// the n vectors in passes of up to kVecs, columns in tiles of two vectors. A tile's accumulators start from out and
// take R rows' products, so every output element sums its rows in row order (as the scalar tier does). Ops (a
// tier's vector type and its operations, below) is instantiated inside each tier's file, compiled with its flags.
//   struct Ops { using V = ...; static constexpr int kW = lanes;
//                static V load(const float*); static V load_bf16(const uint16_t*); static void store(float*, V);
//                static V set1(float); static V fma(V a, V b, V acc); };
#pragma once
#include <immintrin.h>

#include <algorithm>

#include "kernels.h"

namespace ftjax {

// Weight lanes [h, h + W) of row `row` of an f32 or bf16 matrix.
template <class Ops>
inline typename Ops::V axpy_weights(const MatrixRef& w, int64_t row, int64_t h) {
  if (w.format == WeightFormat::kBF16) return Ops::load_bf16(reinterpret_cast<const uint16_t*>(w.data) + row * w.ld + h);
  return Ops::load(reinterpret_cast<const float*>(w.data) + row * w.ld + h);
}

// Rows [i, i + R) into vectors j0 .. j0 + N - 1, columns [h0, h1). Each row is prefetched pf bytes ahead of its loads;
// past its columns' end, the same distance into the row R further on (the next step's), while that is below i_end.
template <class Ops, int R, int N>
inline void axpy_step(const MatrixRef& w, int64_t i, int64_t i_end, const float* const* c, int j0, int64_t h0,
                      int64_t h1, float* const* out, int64_t pf) {
  using V = typename Ops::V;
  constexpr int kW = Ops::kW;
  const int64_t esize = w.format == WeightFormat::kF32 ? 4 : 2, pf_el = pf / esize, cols = h1 - h0;
  V cv[R][N];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) cv[r][j] = Ops::set1(c[j0 + j][i + r]);
  const char* base = reinterpret_cast<const char*>(w.data);
  int64_t h = h0;
  for (; h + 2 * kW <= h1; h += 2 * kW) {
    if (pf_el > 0) {
      const int64_t at = h + pf_el;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        if (at < h1) _mm_prefetch(base + ((i + r) * w.ld + at) * esize, _MM_HINT_T0);
        else if (i + r + R < i_end && at - cols < h1)
          _mm_prefetch(base + ((i + r + R) * w.ld + at - cols) * esize, _MM_HINT_T0);
      }
    }
    V acc[N][2];
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) {
      acc[j][0] = Ops::load(out[j0 + j] + h);
      acc[j][1] = Ops::load(out[j0 + j] + h + kW);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V a = axpy_weights<Ops>(w, i + r, h), b = axpy_weights<Ops>(w, i + r, h + kW);
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) {
        acc[j][0] = Ops::fma(a, cv[r][j], acc[j][0]);
        acc[j][1] = Ops::fma(b, cv[r][j], acc[j][1]);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) {
      Ops::store(out[j0 + j] + h, acc[j][0]);
      Ops::store(out[j0 + j] + h + kW, acc[j][1]);
    }
  }
  for (; h < h1; ++h)  // the columns past the last whole tile
    for (int j = 0; j < N; ++j) {
      float s = out[j0 + j][h];
      for (int r = 0; r < R; ++r) s += c[j0 + j][i + r] * dense_weight(w, i + r, h);
      out[j0 + j][h] = s;
    }
}

template <class Ops, int R, int N>
inline void axpy_step_upto(int n, const MatrixRef& w, int64_t i, int64_t i_end, const float* const* c, int j0,
                           int64_t h0, int64_t h1, float* const* out, int64_t pf) {
  if constexpr (N > 1) {
    if (n < N) return axpy_step_upto<Ops, R, N - 1>(n, w, i, i_end, c, j0, h0, h1, out, pf);
  }
  axpy_step<Ops, R, N>(w, i, i_end, c, j0, h0, h1, out, pf);
}

template <class Ops, int kVecs>
inline void axpy_rows_tiled(const MatrixRef& w, int64_t i0, int64_t i1, const float* const* c, int n, int64_t h0,
                            int64_t h1, float* const* out) {
  constexpr int R = 4;
  const int64_t pf = prefetch_bytes();
  for (int j0 = 0; j0 < n; j0 += kVecs) {
    const int m = std::min(kVecs, n - j0);
    int64_t i = i0;
    for (; i + R <= i1; i += R) axpy_step_upto<Ops, R, kVecs>(m, w, i, i1, c, j0, h0, h1, out, pf);
    for (; i < i1; ++i) axpy_step_upto<Ops, 1, kVecs>(m, w, i, i1, c, j0, h0, h1, out, pf);
  }
}

}  // namespace ftjax
