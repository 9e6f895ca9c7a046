// router.h — MoE router: per-token expert scores, top-k selection, combine weights, and the
// load-balancing (aux) and z losses. Family `router`: `softmax_topk` (Qwen3-MoE, baseline) and
// `sigmoid_topk` (DeepSeek-V3: sigmoid scores, selection bias for aux-loss-free balancing,
// group-limited top-k). Both are one function selected by RouterConfig::score.
//
// Legend: T tokens, E experts, K top-k, G expert groups.
// Accumulation convention: the router has no parameters of its own here (the gate projection
// that produces the logits is a linear layer); router_backward WRITES d_logits (=).
//
// Selection is piecewise constant: gradients flow only through the scores of the selected
// experts (combine weights), the aux loss (through mean scores; counts are constants) and the
// z loss. The expert bias changes selection only and gets no gradient.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace bb {

enum class RouterScore { softmax, sigmoid };

struct RouterConfig {
  int num_experts = 0, top_k = 0;
  RouterScore score = RouterScore::softmax;
  bool norm_topk_prob = true;   // renormalise the K selected weights to sum to 1
  float routed_scaling = 1.0f;  // multiply final weights (DeepSeek-style), 1 for Qwen
  // Group-limited top-k (DeepSeek-V3): experts split into num_groups equal groups; a group's
  // score is the sum of its two best selection scores (its best if a group has one expert);
  // only experts of the topk_groups best groups may be selected. 1 / 1 = off.
  int num_groups = 1, topk_groups = 1;
  // Throws bb::Error naming the bad field: top_k outside [1, num_experts], num_experts < 1,
  // num_experts not divisible by num_groups, topk_groups outside [1, num_groups], top_k larger
  // than the experts in the allowed groups, routed_scaling not positive.
  void validate() const;
};

// What router_backward needs. Category activations.
struct RouterSaved {
  Tensor scores;    // [T, E] f32: softmax probs or sigmoid scores (no bias)
  Tensor topk_idx;  // [T, K] i32: the selection (same values as RouterOutput::topk_idx)
};

struct RouterOutput {
  // [T, K] i32: experts in order of decreasing selection score; ties -> lower index.
  Tensor topk_idx;
  Tensor topk_prob;                        // [T, K] f32 combine weights (category activations)
  std::vector<int64_t> tokens_per_expert;  // [E] host counts
  // Switch-style: E * sum_e (count_e / T) * mean_t(p_te) (HF Qwen3-MoE load_balancing_loss_func
  // for one layer; p = softmax probs; for sigmoid routing p = scores normalised per token).
  double aux_loss = 0;
  double z_loss = 0;  // mean_t (logsumexp_e logits_te)^2
};

// A selection decided earlier, to be used instead of the top-k search: the first forward's
// routing when a full-recompute pass reruns the layer, or routing given as input (RL router
// replay). topk_idx [T, K] i32 on the logits' device, values in [0, E); tokens_per_expert [E]
// its counts (trusted, as make_permute_map's known_counts).
struct RouterReplay {
  Tensor topk_idx;
  std::vector<int64_t> tokens_per_expert;
};

// A routing that loads every expert equally: token t's k-th choice is expert
// (t + k * stride) mod E with stride = E / K (integer division), so each token's K experts are
// distinct and spread over the expert range (over every rank of an expert-parallel group), and
// every expert receives T K / E rows, +-K. topk_idx [T, K] i32 on `dev` (category other). The
// emulated communication backend routes with it (comm/emulated.h), so that a rank's expert load
// is that of a balanced job.
RouterReplay balanced_routing(int64_t tokens, int64_t num_experts, int64_t top_k, Device dev);
// [T, E] f32 on `dev` (category other): `magnitude` at each token's experts of `r`, 0 elsewhere.
// Added to router logits of magnitude well below it, the router's own top-k picks r's experts
// (and reads its counts back as it always does).
Tensor routing_logit_bias(const RouterReplay& r, int64_t num_experts, float magnitude, Device dev);

// logits [T, E] f32 (in). expert_bias [E] f32 (in) or undefined: added to the scores for
// SELECTION only, never to the weights (aux-loss-free balancing; meant for sigmoid routing but
// accepted for softmax too). With s = scores and S the selected set of token t:
//   topk_prob[t, k] = routed_scaling * s[t, idx_k] / (norm_topk_prob ? sum_{j in S} s[t, j] : 1)
// `saved` may be null when no backward follows.
// With `replay`, S is replay->topk_idx: the output's topk_idx is that tensor, tokens_per_expert
// its counts, topk_prob and saved->scores are computed from the logits as above (bit-identical
// to the forward that chose S), and aux_loss and z_loss are not computed (0). On CUDA a replayed
// forward makes no host synchronisation.
RouterOutput router_forward(const Tensor& logits, const Tensor& expert_bias,
                            const RouterConfig& cfg, RouterSaved* saved,
                            const RouterReplay* replay = nullptr);

// d_topk_prob [T, K] f32 (in; undefined = zeros); d_aux, d_z: upstream gradients of aux_loss and
// z_loss; logits [T, E] f32 (in, the forward's input). Returns d_logits [T, E] f32, category
// activations (WRITTEN).
Tensor router_backward(const Tensor& d_topk_prob, double d_aux, double d_z, const Tensor& logits,
                       const RouterConfig& cfg, const RouterSaved& saved);

// Aux-loss-free balancing (DeepSeek-V3): bias_e += rate * sign(mean_count - count_e), so
// overloaded experts become less likely to be selected. expert_bias [E] f32 (in/out).
void update_expert_bias(Tensor& expert_bias, const std::vector<int64_t>& tokens_per_expert,
                        float rate);

}  // namespace bb
