// gdn_gates.h — the gates of the gated delta rule (Qwen3.5 Gated DeltaNet layers):
//   g = -exp(A_log) * softplus(a + dt_bias)  (log decay, <= 0),   beta = sigmoid(b)
// (equations and derivatives in gdn_gates_ref.h; softplus as torch computes it: = x above 20).
//
// Tensors (legend: T tokens, Hv value heads):
//   a, b             [T, Hv]  f32 or bf16   the in_proj_a / in_proj_b projections
//   a_log, dt_bias   [Hv]     f32           per-head parameters (kept in f32 in every model)
//   g, beta          [T, Hv]  f32           outputs, category activations
// Backward: d_a, d_b written (f32 [T, Hv], activations); d_a_log, d_dt_bias accumulated (+=,
// f32 [Hv]); g and beta are the forward's outputs (nothing else is saved).
// Devices: CPU (the reference) and CUDA (gdn_gates_cuda.cu: elementwise, and the per-head sums
// over tokens reduced in a fixed order, so deterministic). All tensors on one device; no host
// synchronisation on the GPU.
#pragma once

#include <utility>

#include "core/tensor.h"

namespace bb {

struct GdnGates {
  Tensor g, beta;
};

GdnGates gdn_gates_forward(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias);
// Returns {d_a, d_b}; adds into d_a_log and d_dt_bias.
std::pair<Tensor, Tensor> gdn_gates_backward(const Tensor& d_g, const Tensor& d_beta, const Tensor& a,
                                             const Tensor& g, const Tensor& beta, const Tensor& a_log,
                                             const Tensor& dt_bias, Tensor& d_a_log, Tensor& d_dt_bias);

}  // namespace bb
