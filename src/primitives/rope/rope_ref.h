// rope_ref.h — CPU reference for rotary position embedding, rotate-half convention (HF Llama/Qwen).
//
// For a head vector x[0..D) and rotary width R (even, R <= D), pairs (i, i + R/2), i < R/2:
//   inv_freq_i = theta^(-2i/R)     a = pos * inv_freq_i
//   y_i       = x_i cos a - x_{i+R/2} sin a
//   y_{i+R/2} = x_{i+R/2} cos a + x_i sin a
//   y_j = x_j for j >= R (partial rotary passes the tail through)
// The angle is formed in fp32 exactly as the Hugging Face reference does (inv_freq in fp32,
// pos * inv_freq in fp32), so positions far out match it bit for bit in the angle.
// Backward is the rotation by -a (the map is orthogonal).
#pragma once

#include <cmath>
#include <cstdint>

namespace bb::ref {

inline float rope_inv_freq(int64_t i, int64_t R, double theta) {
  // HF: 1.0 / (base ** (arange(0, R, 2).float() / R)), computed in fp32.
  const float expo = static_cast<float>(2 * i) / static_cast<float>(R);
  return 1.0f / std::pow(static_cast<float>(theta), expo);
}

// x, y: [T, n, D]; positions: [T]. sign = +1 forward, -1 backward.
template <class T>
void rope_apply(T* y, const T* x, const int32_t* positions, int64_t tokens, int64_t heads,
                int64_t D, int64_t R, double theta, int sign) {
  const int64_t half = R / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(positions[t]) * rope_inv_freq(i, R, theta);
      const T c = static_cast<T>(std::cos(a));
      const T s = static_cast<T>(sign) * static_cast<T>(std::sin(a));
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * D;
        T* yr = y + (t * heads + h) * D;
        const T x1 = xr[i], x2 = xr[i + half];
        yr[i] = x1 * c - x2 * s;
        yr[i + half] = x2 * c + x1 * s;
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = R; j < D; ++j) y[(t * heads + h) * D + j] = x[(t * heads + h) * D + j];
  }
}

}  // namespace bb::ref
