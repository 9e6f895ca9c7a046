// attention.h — causal GQA attention over packed sequences: the `sdpa` family baseline.
//
// Legend: T tokens (all sequences packed back to back), B sequences, Hq query heads, Hkv kv
// heads (Hq % Hkv == 0; query head h reads kv head h / (Hq / Hkv)), D head dim.
//   q           [T, Hq, D]   f32 or bf16            in
//   k, v        [T, Hkv, D]  q's dtype              in
//   cu_seqlens  [B+1]        i32, host              in   sequence b = tokens [cu[b], cu[b+1]);
//                                                        cu[0] = 0, non-decreasing, cu[B] = T
//                                                        (empty sequences allowed)
//   o           [T, Hq, D]   q's dtype, activations out  o_i = softmax_j<=i(scale q_i.k_j) v
//   saved.lse   [Hq, T]      f32, activations       out  log sum_j<=i exp(scale q_i.k_j)
// Keys j run over the query's own sequence only, up to and including i (causal); nothing is
// attended across a sequence boundary. The CPU path sums in f32 through blocked BLAS; the plain-loop reference (attention_ref.h) in double.
//
// Backward: dq, dk, dv are activation gradients, WRITTEN (=) into new tensors with the shapes and
// dtypes of q, k, v (category activations). It needs q, k, v, o and saved.lse; the softmax matrix
// is recomputed from lse (flash-attention style), never stored.
// Alternatives of the family (cp_ring, cp_a2a; later) keep these signatures.
#pragma once

#include "core/tensor.h"

namespace bb {

struct AttentionSaved {
  Tensor lse;  // [Hq, T] f32, category activations: log-sum-exp of the scaled scores
};

// Returns o [T, Hq, D] (q's dtype, activations). `saved` may be null (inference, or a recompute
// that only needs o).
Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& cu_seqlens, float softmax_scale, AttentionSaved* saved);

struct AttentionGrads {
  Tensor dq;  // [T, Hq, D]   q's dtype, activations
  Tensor dk;  // [T, Hkv, D]  k's dtype, activations (summed over the kv head's query heads)
  Tensor dv;  // [T, Hkv, D]  v's dtype, activations (summed over the kv head's query heads)
};

// d_o and o: [T, Hq, D] in q's dtype; the other arguments exactly as given to / returned by the
// forward (same cu_seqlens and softmax_scale).
AttentionGrads attention_backward(const Tensor& d_o, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& o, const Tensor& cu_seqlens,
                                  float softmax_scale, const AttentionSaved& saved);

}  // namespace bb
