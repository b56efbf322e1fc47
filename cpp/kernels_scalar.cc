// Portable tier: plain loops. Also the arithmetic the SIMD tiers must match (up to summation order).
#include "kernels.h"

namespace ftjax {

void dot_rows_scalar(const MatrixRef& w, int64_t r0, int64_t r1, const ActRef& a, float* out) {
  const int64_t K = w.cols, ld = w.ld;
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < a.n; ++j) {
      const float* x = a.f32 + j * a.stride;
      float acc = 0.f;
      switch (w.format) {
        case WeightFormat::kF32: {
          const float* row = reinterpret_cast<const float*>(w.data) + r * ld;
          for (int64_t k = 0; k < K; ++k) acc += row[k] * x[k];
          break;
        }
        case WeightFormat::kBF16: {
          const uint16_t* row = reinterpret_cast<const uint16_t*>(w.data) + r * ld;
          for (int64_t k = 0; k < K; ++k) acc += bf16_to_f32(row[k]) * x[k];
          break;
        }
        case WeightFormat::kInt4: {
          const uint8_t* row = w.data + r * (ld / 2);
          const uint16_t* sc = w.scales + r * (ld / 32);
          for (int64_t g = 0; g < K / 32; ++g) {
            float part = 0.f;
            for (int i = 0; i < 16; ++i) {
              const uint8_t b = row[g * 16 + i];
              part += static_cast<float>((b & 0xF) - 8) * x[g * 32 + 2 * i];
              part += static_cast<float>((b >> 4) - 8) * x[g * 32 + 2 * i + 1];
            }
            acc += part * bf16_to_f32(sc[g]);
          }
          break;
        }
      }
      out[(r - r0) * a.n + j] = acc;
    }
  }
}

void axpy_rows_scalar(const MatrixRef& w, int64_t i0, int64_t i1, const float* const* c, int n, int64_t h0,
                      int64_t h1, float* const* out) {
  for (int64_t i = i0; i < i1; ++i)
    for (int j = 0; j < n; ++j) {
      const float cj = c[j][i];
      float* o = out[j];
      for (int64_t h = h0; h < h1; ++h) o[h] += cj * dense_weight(w, i, h);
    }
}

}  // namespace ftjax
