// swiglu_ref.h — CPU reference of the SwiGLU activation, templated over the scalar type.
//
// Plain loops on raw pointers (llm.c style). Tests run the forward in double for finite
// differences and the backward in float. Shapes: N rows, F ffn dim; gate_up rows hold the gate
// in columns [0, F) and the up projection in [F, 2F) (HF gate_proj rows, then up_proj rows).
//
//   h = silu(g) * u,  silu(g) = g * sigmoid(g)
//   d_g = d_h * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  d_u = d_h * silu(g)
//
// The backward WRITES d_gate_up (an activation gradient).
#pragma once

#include <cmath>
#include <cstdint>

namespace bb::ref {

template <class T>
inline T stable_sigmoid(T x) {
  // Split by sign so exp never overflows.
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

// h [N, F] <- silu(gate_up[:, :F]) * gate_up[:, F:]; gate_up [N, 2F].
template <class T>
void swiglu_forward(T* h, const T* gate_up, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    const T* g = gate_up + n * 2 * F;
    const T* u = g + F;
    T* out = h + n * F;
    for (int64_t j = 0; j < F; ++j) out[j] = g[j] * stable_sigmoid(g[j]) * u[j];
  }
}

// d_gate_up [N, 2F] <- gradient of h = swiglu(gate_up) given d_h [N, F].
template <class T>
void swiglu_backward(T* d_gate_up, const T* d_h, const T* gate_up, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    const T* g = gate_up + n * 2 * F;
    const T* u = g + F;
    const T* dh = d_h + n * F;
    T* dg = d_gate_up + n * 2 * F;
    T* du = dg + F;
    for (int64_t j = 0; j < F; ++j) {
      const T s = stable_sigmoid(g[j]);
      dg[j] = dh[j] * u[j] * s * (T(1) + g[j] * (T(1) - s));
      du[j] = dh[j] * g[j] * s;
    }
  }
}

}  // namespace bb::ref
