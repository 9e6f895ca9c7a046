// permute.h — MoE token permutation: gather each token's K copies into rows grouped by expert
// (so every expert sees one contiguous slice) and scatter-combine the expert outputs back.
// Family `permute`:
//   standard:         y[t] = sum_k p[t,k] * expert(x[t])       (prob applied at unpermute;
//                     its backward needs the expert output y_perm to form d_prob)
//   memory_efficient: the prob is folded into the experts before the down projection
//                     (permute_probs -> experts row_prob) and unpermute uses unit weights, so
//                     y_perm need not be kept for backward.
//
// Legend: T tokens, K top-k, E experts, H hidden, N = T*K permuted rows.
// Row order: grouped by expert (expert 0 first); within an expert by token, then by k (stable).
// Accumulation convention: no parameters; backward functions WRITE their outputs (=).
// Data tensors may be f32, bf16 or f16 (sums in fp32, stored in the input dtype);
// probabilities are f32.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace bb {

// Where the routing probability is applied (the family's members, see above).
enum class PermuteMode { standard, memory_efficient };

struct PermuteMap {
  int64_t num_tokens = 0, top_k = 0, num_experts = 0;
  Tensor row_token;  // [N = T*K] i32: source token of each permuted row (category moe)
  Tensor slot_row;   // [T, K] i32: permuted row of copy (t, k) (category moe)
  std::vector<int64_t> tokens_per_expert;  // [E]; expert e owns rows [off_e, off_e + count_e)
  int64_t num_rows() const { return num_tokens * top_k; }
};

// topk_idx [T, K] i32 (in), values in [0, num_experts). T >= 1.
// known_counts: the tokens per expert when the caller already has them on the host (the router
// returns them): the CUDA path then skips its host synchronisation (reading the counts and the
// range check back). They must be the counts of topk_idx; the values are trusted.
PermuteMap make_permute_map(const Tensor& topk_idx, int64_t num_experts,
                            const std::vector<int64_t>* known_counts = nullptr);

// x [T, H] float (in) -> x_perm [N, H], dtype of x, category moe: x_perm[n] = x[row_token[n]].
Tensor permute_forward(const Tensor& x, const PermuteMap& map);
// d_x_perm [N, H] float (in) -> d_x [T, H], its dtype (f32 when out_f32: the fp32 sum
// unrounded, for a caller that continues in f32), category activations:
//   d_x[t] = sum_k d_x_perm[slot_row[t, k]].
Tensor permute_backward(const Tensor& d_x_perm, const PermuteMap& map, bool out_f32 = false);

// y_perm [N, H] float (in), topk_prob [T, K] f32 (in) or undefined (= weights 1, the
// memory_efficient variant) -> y [T, H], dtype of y_perm, category `out_cat`:
//   y[t] = sum_k w[t, k] * y_perm[slot_row[t, k]]   (fp32 accumulation)
Tensor unpermute_forward(const Tensor& y_perm, const PermuteMap& map, const Tensor& topk_prob,
                         MemCategory out_cat = MemCategory::activations);

struct UnpermuteGrads {
  Tensor d_y_perm;     // [N, H], dtype of d_y, category moe: w[t,k] * d_y[t] at slot_row[t,k]
  Tensor d_topk_prob;  // [T, K] f32, category activations: <d_y[t], y_perm[slot_row[t,k]]>;
                       // undefined when topk_prob is undefined
};
// d_y [T, H] float (in); y_perm [N, H] float (in; may be undefined when topk_prob is);
// topk_prob [T, K] f32 (in) or undefined.
UnpermuteGrads unpermute_backward(const Tensor& d_y, const Tensor& y_perm, const PermuteMap& map,
                                  const Tensor& topk_prob);

// topk_prob [T, K] f32 (in) -> row_prob [N] f32, category moe: row_prob[slot_row[t,k]] = p[t,k].
Tensor permute_probs(const Tensor& topk_prob, const PermuteMap& map);
// d_row_prob [N] f32 (in) -> d_topk_prob [T, K] f32, category activations (the transpose).
Tensor unpermute_probs_grad(const Tensor& d_row_prob, const PermuteMap& map);

}  // namespace bb
