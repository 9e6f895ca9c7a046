// gated_rmsnorm_ref.h — CPU reference of the gated RMSNorm of Gated DeltaNet layers
// (templated over the scalar type for finite-difference checks).
//
// Per row (one head vector of width D):
//   r = 1 / sqrt(mean(x^2) + eps),  xhat = x r,  y = w * xhat * silu(z)      (norm before gate)
// Backward (dx, dz written; dw accumulated):
//   gz = silu(z);  u = dy * gz                     (what plain RMSNorm sees as its dy)
//   dw += sum_rows u * xhat
//   dx  = r (u w - xhat mean(u w xhat))
//   dz  = dy * w * xhat * silu'(z),   silu'(z) = s (1 + z (1 - s)), s = sigmoid(z)
#pragma once

#include <cmath>
#include <cstdint>

namespace bb::ref {

template <class T>
T silu_of(T z) {
  return z / (T(1) + std::exp(-z));
}
template <class T>
T silu_grad(T z) {
  const T s = T(1) / (T(1) + std::exp(-z));
  return s * (T(1) + z * (T(1) - s));
}

template <class T>
void gated_rmsnorm_forward(T* y, const T* x, const T* z, const T* w, int64_t rows, int64_t D, double eps) {
  for (int64_t t = 0; t < rows; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[t * D + i]) * x[t * D + i];
    const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
    for (int64_t i = 0; i < D; ++i) y[t * D + i] = w[i] * (x[t * D + i] * r) * silu_of(z[t * D + i]);
  }
}

template <class T>
void gated_rmsnorm_backward(T* dx, T* dz, T* dw, const T* dy, const T* x, const T* z, const T* w, int64_t rows,
                            int64_t D, double eps) {
  for (int64_t t = 0; t < rows; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[t * D + i]) * x[t * D + i];
    const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
    double dot = 0;
    for (int64_t i = 0; i < D; ++i) {
      const T xh = x[t * D + i] * r, u = dy[t * D + i] * silu_of(z[t * D + i]);
      dot += static_cast<double>(u) * w[i] * xh;
    }
    const T mean = static_cast<T>(dot / static_cast<double>(D));
    for (int64_t i = 0; i < D; ++i) {
      const int64_t e = t * D + i;
      const T xh = x[e] * r, u = dy[e] * silu_of(z[e]);
      dw[i] += u * xh;
      dx[e] = r * (u * w[i] - xh * mean);
      dz[e] = dy[e] * w[i] * xh * silu_grad(z[e]);
    }
  }
}

}  // namespace bb::ref
