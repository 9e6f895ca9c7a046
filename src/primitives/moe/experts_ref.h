// experts_ref.h — CPU reference of the SwiGLU expert MLPs over permuted rows, templated over the
// scalar type. Two independent implementations that must agree to fp32 rounding:
//   *_sequential: one BLAS GEMM per expert slice (the `sequential` family baseline);
//   *_grouped:    one pass over all rows, each row multiplied by its own expert's weights in plain
//                 loops (the CPU stand-in for a grouped GEMM).
//
// Legend: N permuted rows, H hidden, F ffn dim, E experts. counts [E]: expert e owns rows
// [off_e, off_e + counts[e]), off_e = sum_{e' < e} counts[e'].
// Weights: w_gate_up [E, 2F, H] (gate rows, then up rows), w_down [E, H, F].
// row_prob [N] or null: if given, the activation is scaled by it before the down projection.
//   gate_up = x W_gu[e]^T;  act = swiglu(gate_up);  a = p * act (or act);  y = a W_down[e]^T
// Backward: d_x, d_row_prob, d_gate_up are WRITTEN (=); d_w_gate_up, d_w_down ACCUMULATED (+=).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cpu/gemm.h"
#include "primitives/activation/swiglu_ref.h"

namespace bb::ref {

// ---- sequential: one GEMM per expert ---------------------------------------------------------

// y [N, H], gate_up [N, 2F], act [N, F] (unscaled swiglu output) <- x [N, H]. y null: gate_up
// and act only (the same arithmetic), no down projection (experts_forward_saved).
template <class T>
void experts_forward_sequential(T* y, T* gate_up, T* act, const T* x, const int64_t* counts,
                                int64_t E, const T* w_gate_up, const T* w_down, const T* row_prob,
                                int64_t H, int64_t F) {
  std::vector<T> scaled;
  int64_t off = 0;
  for (int64_t e = 0; e < E; off += counts[e], ++e) {
    const int64_t c = counts[e];
    if (c == 0) continue;
    T* gu = gate_up + off * 2 * F;
    T* a = act + off * F;
    cpu::gemm<T>(false, true, c, 2 * F, H, T(1), x + off * H, w_gate_up + e * 2 * F * H, T(0), gu);
    swiglu_forward(a, gu, c, F);
    if (!y) continue;
    const T* a_in = a;
    if (row_prob) {
      scaled.resize(c * F);
      for (int64_t n = 0; n < c; ++n)
        for (int64_t j = 0; j < F; ++j) scaled[n * F + j] = row_prob[off + n] * a[n * F + j];
      a_in = scaled.data();
    }
    cpu::gemm<T>(false, true, c, H, F, T(1), a_in, w_down + e * H * F, T(0), y + off * H);
  }
}

// d_x [N, H], d_row_prob [N] (only if row_prob), d_gate_up [N, 2F] <- d_y [N, H].
template <class T>
void experts_backward_data_sequential(T* d_x, T* d_row_prob, T* d_gate_up, const T* d_y,
                                      const T* gate_up, const T* act, const int64_t* counts,
                                      int64_t E, const T* w_gate_up, const T* w_down,
                                      const T* row_prob, int64_t H, int64_t F) {
  std::vector<T> d_a;
  int64_t off = 0;
  for (int64_t e = 0; e < E; off += counts[e], ++e) {
    const int64_t c = counts[e];
    if (c == 0) continue;
    d_a.resize(c * F);
    // d_a = d_y W_down[e]: [c, H] x [H, F].
    cpu::gemm<T>(false, false, c, F, H, T(1), d_y + off * H, w_down + e * H * F, T(0), d_a.data());
    if (row_prob) {
      for (int64_t n = 0; n < c; ++n) {
        T dot = 0;
        for (int64_t j = 0; j < F; ++j) dot += d_a[n * F + j] * act[(off + n) * F + j];
        d_row_prob[off + n] = dot;
        for (int64_t j = 0; j < F; ++j) d_a[n * F + j] *= row_prob[off + n];
      }
    }
    T* dgu = d_gate_up + off * 2 * F;
    swiglu_backward(dgu, d_a.data(), gate_up + off * 2 * F, c, F);
    // d_x = d_gate_up W_gu[e]: [c, 2F] x [2F, H].
    cpu::gemm<T>(false, false, c, H, 2 * F, T(1), dgu, w_gate_up + e * 2 * F * H, T(0),
                 d_x + off * H);
  }
}

// d_w_gate_up [E, 2F, H] += d_gate_up^T x;  d_w_down [E, H, F] += d_y^T (p * act).
template <class T>
void experts_backward_weight_sequential(T* d_w_gate_up, T* d_w_down, const T* d_y, const T* x,
                                        const T* act, const T* d_gate_up, const T* row_prob,
                                        const int64_t* counts, int64_t E, int64_t H, int64_t F) {
  std::vector<T> scaled;
  int64_t off = 0;
  for (int64_t e = 0; e < E; off += counts[e], ++e) {
    const int64_t c = counts[e];
    if (c == 0) continue;
    const T* a = act + off * F;
    if (row_prob) {
      scaled.resize(c * F);
      for (int64_t n = 0; n < c; ++n)
        for (int64_t j = 0; j < F; ++j) scaled[n * F + j] = row_prob[off + n] * a[n * F + j];
      a = scaled.data();
    }
    cpu::gemm<T>(true, false, H, F, c, T(1), d_y + off * H, a, T(1), d_w_down + e * H * F);
    cpu::gemm<T>(true, false, 2 * F, H, c, T(1), d_gate_up + off * 2 * F, x + off * H, T(1),
                 d_w_gate_up + e * 2 * F * H);
  }
}

// ---- grouped: one pass over all rows ---------------------------------------------------------

// row_expert [N] <- the expert owning each row.
inline std::vector<int32_t> experts_row_expert(const int64_t* counts, int64_t E) {
  std::vector<int32_t> owner;
  for (int64_t e = 0; e < E; ++e) owner.insert(owner.end(), counts[e], static_cast<int32_t>(e));
  return owner;
}

// As experts_forward_sequential, y null included.
template <class T>
void experts_forward_grouped(T* y, T* gate_up, T* act, const T* x, const int64_t* counts, int64_t E,
                             const T* w_gate_up, const T* w_down, const T* row_prob, int64_t H,
                             int64_t F) {
  const std::vector<int32_t> owner = experts_row_expert(counts, E);
  const int64_t N = static_cast<int64_t>(owner.size());
  for (int64_t n = 0; n < N; ++n) {
    const T* wgu = w_gate_up + owner[n] * 2 * F * H;
    const T* xn = x + n * H;
    T* gu = gate_up + n * 2 * F;
    T* a = act + n * F;
    for (int64_t i = 0; i < 2 * F; ++i) {
      T s = 0;
      for (int64_t j = 0; j < H; ++j) s += wgu[i * H + j] * xn[j];
      gu[i] = s;
    }
    for (int64_t j = 0; j < F; ++j) a[j] = gu[j] * stable_sigmoid(gu[j]) * gu[F + j];
    if (!y) continue;
    const T* wd = w_down + owner[n] * H * F;
    const T p = row_prob ? row_prob[n] : T(1);
    for (int64_t i = 0; i < H; ++i) {
      T s = 0;
      for (int64_t j = 0; j < F; ++j) s += wd[i * F + j] * a[j];
      y[n * H + i] = p * s;
    }
  }
}

template <class T>
void experts_backward_data_grouped(T* d_x, T* d_row_prob, T* d_gate_up, const T* d_y,
                                   const T* gate_up, const T* act, const int64_t* counts, int64_t E,
                                   const T* w_gate_up, const T* w_down, const T* row_prob,
                                   int64_t H, int64_t F) {
  const std::vector<int32_t> owner = experts_row_expert(counts, E);
  const int64_t N = static_cast<int64_t>(owner.size());
  std::vector<T> d_a(F);
  for (int64_t n = 0; n < N; ++n) {
    const T* wgu = w_gate_up + owner[n] * 2 * F * H;
    const T* wd = w_down + owner[n] * H * F;
    const T* dy = d_y + n * H;
    const T* gu = gate_up + n * 2 * F;
    const T* a = act + n * F;
    for (int64_t j = 0; j < F; ++j) {
      T s = 0;
      for (int64_t i = 0; i < H; ++i) s += dy[i] * wd[i * F + j];
      d_a[j] = s;
    }
    if (row_prob) {
      T dot = 0;
      for (int64_t j = 0; j < F; ++j) dot += d_a[j] * a[j];
      d_row_prob[n] = dot;
    }
    const T p = row_prob ? row_prob[n] : T(1);
    T* dgu = d_gate_up + n * 2 * F;
    for (int64_t j = 0; j < F; ++j) {
      const T g = gu[j], u = gu[F + j], s = stable_sigmoid(g), da = p * d_a[j];
      dgu[j] = da * u * s * (T(1) + g * (T(1) - s));
      dgu[F + j] = da * g * s;
    }
    for (int64_t j = 0; j < H; ++j) {
      T s = 0;
      for (int64_t i = 0; i < 2 * F; ++i) s += dgu[i] * wgu[i * H + j];
      d_x[n * H + j] = s;
    }
  }
}

template <class T>
void experts_backward_weight_grouped(T* d_w_gate_up, T* d_w_down, const T* d_y, const T* x,
                                     const T* act, const T* d_gate_up, const T* row_prob,
                                     const int64_t* counts, int64_t E, int64_t H, int64_t F) {
  const std::vector<int32_t> owner = experts_row_expert(counts, E);
  const int64_t N = static_cast<int64_t>(owner.size());
  for (int64_t n = 0; n < N; ++n) {
    T* dwgu = d_w_gate_up + owner[n] * 2 * F * H;
    T* dwd = d_w_down + owner[n] * H * F;
    const T p = row_prob ? row_prob[n] : T(1);
    for (int64_t i = 0; i < H; ++i) {
      const T dy = d_y[n * H + i];
      for (int64_t j = 0; j < F; ++j) dwd[i * F + j] += dy * p * act[n * F + j];
    }
    for (int64_t i = 0; i < 2 * F; ++i) {
      const T dg = d_gate_up[n * 2 * F + i];
      for (int64_t j = 0; j < H; ++j) dwgu[i * H + j] += dg * x[n * H + j];
    }
  }
}

}  // namespace bb::ref
