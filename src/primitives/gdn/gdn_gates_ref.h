// gdn_gates_ref.h — CPU reference of the Gated DeltaNet gates (templated over the scalar type).
//
// Per token t and value head h, from the projections a, b [T, Hv] and per-head A_log, dt [Hv]:
//   u    = a + dt
//   g    = -exp(A_log) * softplus(u)          softplus(u) = log(1 + e^u), = u above 20 (torch)
//   beta = sigmoid(b)
// Backward (d_a, d_b written; d_A_log, d_dt accumulated over tokens):
//   d_u     = d_g * (-exp(A_log)) * sigmoid(u)     (0 threshold branch: d softplus = 1 above 20)
//   d_a     = d_u;  d_dt += sum_t d_u;  d_A_log += sum_t d_g * g
//   d_b     = d_beta * beta * (1 - beta)
#pragma once

#include <cmath>
#include <cstdint>

namespace bb::ref {

template <class T>
T gdn_softplus(T u) {
  return u > T(20) ? u : std::log1p(std::exp(u));
}
template <class T>
T gdn_softplus_grad(T u) {
  return u > T(20) ? T(1) : T(1) / (T(1) + std::exp(-u));
}

template <class T>
void gdn_gates_forward(T* g, T* beta, const T* a, const T* b, const T* a_log, const T* dt, int64_t rows,
                       int64_t Hv) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t i = t * Hv + h;
      g[i] = -std::exp(a_log[h]) * gdn_softplus(a[i] + dt[h]);
      beta[i] = T(1) / (T(1) + std::exp(-b[i]));
    }
}

// Sums over tokens in double (d_a_log, d_dt are accumulated into).
template <class T>
void gdn_gates_backward(T* d_a, T* d_b, T* d_a_log, T* d_dt, const T* d_g, const T* d_beta, const T* a,
                        const T* g, const T* beta, const T* a_log, const T* dt, int64_t rows, int64_t Hv) {
  for (int64_t h = 0; h < Hv; ++h) {
    double s_alog = 0, s_dt = 0;
    const T e = std::exp(a_log[h]);
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t i = t * Hv + h;
      const T du = d_g[i] * (-e) * gdn_softplus_grad(a[i] + dt[h]);
      d_a[i] = du;
      s_dt += static_cast<double>(du);
      s_alog += static_cast<double>(d_g[i]) * g[i];
      d_b[i] = d_beta[i] * beta[i] * (T(1) - beta[i]);
    }
    d_a_log[h] += static_cast<T>(s_alog);
    d_dt[h] += static_cast<T>(s_dt);
  }
}

}  // namespace bb::ref
