// aux_loss.h — the MoE load-balancing loss pooled over the MoE layers of a micro-batch, as
// transformers' load_balancing_loss_func computes it:
//   aux = E * sum_e (c_e / R) * (P_e / R),   R = (MoE layers) x T,
//   c_e = top-k assignments to expert e summed over layers,
//   P_e = sum over layers and tokens of the routing probability p_te (softmax scores; sigmoid
//         scores normalised per token).
// Because c_e pools all layers, the gradient of one layer's logits depends on every layer's
// counts: it cannot come from the per-layer router backward, and add_grad adds it afterwards.
//
// Legend: T tokens, E experts. Use per micro-batch: begin(); add() once per MoE layer in the
// forward (not in a recompute); finish(); value() for the loss; add_grad() in each layer's
// backward. Counts live on the host (the router returns them there); P is an [1, E] f32 device
// tensor, read back only by value().
// Across ranks (context / data parallel) the pool is over the global batch: the runtime sets
// reduce_hook to sum counts, P and R over those ranks; finish() calls it once.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"
#include "primitives/moe/router.h"

namespace bb {

class AuxLossPool {
 public:
  // Sums the pooled quantities over the ranks that share the batch (none on one rank).
  using ReduceHook = std::function<void(std::vector<double>& counts, Tensor& prob_sum,
                                        int64_t& rows)>;
  ReduceHook reduce_hook;

  // Starts a micro-batch of a model with `num_experts` experts whose routers run on `dev`.
  void begin(int64_t num_experts, RouterScore score, Device dev);
  // One MoE layer: scores [T, E] f32 (RouterSaved::scores), its counts [E].
  void add(const Tensor& scores, const std::vector<int64_t>& counts);
  // Ends the forward: applies reduce_hook.
  void finish();
  // The pooled aux loss (0 when no layer was added). One device->host copy on a GPU.
  double value() const;
  // d_logits [T, E] f32 += d(d_aux * aux)/d(logits) of one layer with these scores.
  void add_grad(Tensor& d_logits, const Tensor& scores, double d_aux) const;
  int64_t rows() const { return rows_; }
  const std::vector<double>& counts() const { return counts_; }

 private:
  int64_t num_experts_ = 0;
  RouterScore score_ = RouterScore::softmax;
  std::vector<double> counts_;
  Tensor prob_sum_;  // [1, E] f32
  Tensor ones_;      // [T, 1] f32 ones for the pooling product, kept across micro-batches
  int64_t rows_ = 0;
};

}  // namespace bb
