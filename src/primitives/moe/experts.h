// experts.h — SwiGLU expert MLPs over permuted rows (family `experts`).
//   sequential: one GEMM per expert slice (baseline);
//   grouped:    all experts in one pass (on CPU: a per-row loop using each row's expert
//               weights; on a GPU one grouped GEMM call per projection). Same results to fp32
//               rounding.
//
// Legend: N permuted rows, H hidden, F ffn dim, E experts.
// tokens_per_expert [E] (host): expert e owns rows [off_e, off_e + count_e),
// off_e = sum_{e' < e} count_e'; counts of 0 are fine, sum must equal N (N = 0 is allowed).
// Weights (HF layout): w_gate_up [E, 2F, H] (gate_proj rows, then up_proj rows), w_down [E, H, F].
// row_prob [N] f32 or undefined: if defined (memory_efficient permute) the activation is scaled
// by it BEFORE the down projection:
//   y = W_down[e] (p * swiglu(W_gu[e] x))   or   y = W_down[e] swiglu(W_gu[e] x).
// Accumulation convention: backward_data WRITES d_x, d_row_prob, d_gate_up (=);
// backward_weight ACCUMULATES into d_w_gate_up and d_w_down (+=), or writes them (accumulate = false).
// Data and weights may be f32, bf16 or f16 (computed in fp32; outputs in x_perm's / d_y's dtype).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace bb {

enum class ExpertsImpl { sequential, grouped };

// Saved by the forward for both backward halves. Category activations, dtype of x_perm.
struct ExpertsSaved {
  Tensor gate_up;  // [N, 2F]  W_gu x
  Tensor act;      // [N, F]   unscaled swiglu output
};

// x_perm [N, H] float (in); w_gate_up [E, 2F, H], w_down [E, H, F] float (in); row_prob [N] f32
// (in) or undefined. Returns y_perm [N, H], dtype of x_perm, category moe. `saved` may be null
// when no backward follows.
Tensor experts_forward(ExpertsImpl impl, const Tensor& x_perm,
                       const std::vector<int64_t>& tokens_per_expert, const Tensor& w_gate_up,
                       const Tensor& w_down, const Tensor& row_prob, ExpertsSaved* saved);

// The saved tensors of experts_forward, bit for bit (the same code up to the activation), without
// the down projection (fc2) and without y: what a recompute forward whose output nobody reads
// needs for the backward. Arguments as experts_forward (w_down and row_prob are only checked:
// act is saved unscaled). Fills saved.gate_up [N, 2F] and saved.act [N, F].
void experts_forward_saved(ExpertsImpl impl, const Tensor& x_perm,
                           const std::vector<int64_t>& tokens_per_expert, const Tensor& w_gate_up,
                           const Tensor& w_down, const Tensor& row_prob, ExpertsSaved& saved);

struct ExpertsDgrad {
  Tensor d_x;         // [N, H], dtype of d_y, category moe (goes to permute_backward)
  Tensor d_row_prob;  // [N] f32, category activations: <d_y W_down, act>; undefined w/o row_prob
  Tensor d_gate_up;   // [N, 2F], dtype of d_y, category activations; kept for backward_weight
};
// d_y [N, H] float (in); the weights and row_prob as in the forward; saved from the forward.
ExpertsDgrad experts_backward_data(ExpertsImpl impl, const Tensor& d_y,
                                   const std::vector<int64_t>& tokens_per_expert,
                                   const Tensor& w_gate_up, const Tensor& w_down,
                                   const Tensor& row_prob, const ExpertsSaved& saved);

// d_w_gate_up [E, 2F, H] += d_gate_up^T x_perm;  d_w_down [E, H, F] += d_y^T (p * act).
// d_y [N, H], x_perm [N, H] float (in); dgrad from experts_backward_data (its d_gate_up).
// The gradient tensors may be any float dtype (usually f32, category grads), on the same device as the data.
// accumulate = false writes (=) instead of adding: whatever the gradients held is ignored (NaN
// too), every expert's slice is written, zero for experts without rows. It saves the memset
// before the step and the read of the old gradient (the first write of a step: the model's
// lazily zeroed expert gradients, models/params.h).
void experts_backward_weight(ExpertsImpl impl, const Tensor& d_y, const Tensor& x_perm,
                             const std::vector<int64_t>& tokens_per_expert, const Tensor& row_prob,
                             const ExpertsSaved& saved, const ExpertsDgrad& dgrad,
                             Tensor& d_w_gate_up, Tensor& d_w_down, bool accumulate = true);

}  // namespace bb
