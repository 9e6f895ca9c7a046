// rmsnorm_ref.h — CPU reference for RMSNorm (templated over the scalar type for grad checks).
//
//   rstd_t = 1 / sqrt(mean_h x_th^2 + eps)       y_th = w_h * x_th * rstd_t
// Backward (activation grads written, weight grads accumulated):
//   xhat = x * rstd;  g = dy * w;  dx = rstd * (g - xhat * mean_h(g * xhat));  dw += sum_t dy * xhat
#pragma once

#include <cmath>
#include <cstdint>

namespace bb::ref {

template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int64_t rows, int64_t H, double eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * H;
    double ss = 0;
    for (int64_t h = 0; h < H; ++h) ss += static_cast<double>(xr[h]) * xr[h];
    const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(H) + eps));
    rstd[t] = r;
    for (int64_t h = 0; h < H; ++h) y[t * H + h] = w[h] * (xr[h] * r);
  }
}

template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd,
                      int64_t rows, int64_t H) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * H;
    const T* dyr = dy + t * H;
    const T r = rstd[t];
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += static_cast<double>(dyr[h]) * w[h] * (xr[h] * r);
    const T mean = static_cast<T>(dot / static_cast<double>(H));
    for (int64_t h = 0; h < H; ++h) {
      const T xhat = xr[h] * r;
      dx[t * H + h] = r * (dyr[h] * w[h] - xhat * mean);
      dw[h] += dyr[h] * xhat;
    }
  }
}

}  // namespace bb::ref
