// gated_delta_rule.h — the gated delta rule of Gated DeltaNet layers (Qwen3.5 linear attention)
// over packed variable-length sequences: a K x V state per value head, decayed by exp(g), updated
// with the delta rule at rate beta, read by q (gated_delta_rule_ref.h has the equations).
//
// Tensors (legend: T tokens, Hk key heads, Hv value heads = G x Hk, K key dim, V value dim):
//   q, k        [T, Hk, K]  f32          queries and keys (L2-normalised inside when opts.l2norm)
//   v           [T, Hv, V]  f32          values; value head h reads key head h / G (GVA)
//   g           [T, Hv]     f32          log decay (<= 0 in the model: -exp(A_log) softplus(a + dt_bias))
//   beta        [T, Hv]     f32          write strength (sigmoid(b) in the model)
//   cu_seqlens  [n + 1]     i32, host    sequence i = tokens [cu[i], cu[i+1]); the state starts at
//                                        zero in every sequence and never crosses a boundary
//   o           [T, Hv, V]  f32          output, category `out_cat`
// Backward: every input's gradient written (=), f32, category activations. Nothing is saved
// besides the inputs: the states are rebuilt in backward.
// Devices: the CPU reference (recurrent form). The CUDA chunked kernels are not written yet;
// a CUDA tensor is a clear error.
#pragma once

#include "core/tensor.h"

namespace bb {

struct GatedDeltaOptions {
  double scale = 0;   // multiplies q after the norm; 0 = 1 / sqrt(K)
  bool l2norm = true; // q and k scaled to unit L2 norm (x * rsqrt(|x|^2 + eps)) first
  double eps = 1e-6;
};

struct GatedDeltaGrads {
  Tensor d_q, d_k, d_v, d_g, d_beta;
};

Tensor gated_delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& cu_seqlens,
                                const GatedDeltaOptions& opts = {},
                                MemCategory out_cat = MemCategory::activations);

GatedDeltaGrads gated_delta_rule_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& g, const Tensor& beta,
                                          const Tensor& cu_seqlens,
                                          const GatedDeltaOptions& opts = {});

}  // namespace bb
