// loss_head.h — the loss family's interface: what a model's head calls, whatever the member
// (`full_ce`, `linear_ce`; registered in primitives/registry.cpp). Tensors and formulas as in
// cross_entropy.h: h [T, H], w [V, H] (LM head), targets [T] i32 (< 0 = no loss).
// Accumulation convention: d_w ACCUMULATED (+=, f32 [V, H]), or WRITTEN (=) when the caller says
// so (overwrite_dw: the first write of a step into a lazily zeroed gradient; d_w's old contents
// are then not read and may be anything); d_h WRITTEN (=, allocated f32 under activations when
// undefined on entry).
#pragma once

#include <memory>

#include "core/batch.h"
#include "primitives/loss/cross_entropy.h"

namespace bb {

class LossHead {
 public:
  virtual ~LossHead() = default;
  // Training: the loss and both gradients, with scale = d(objective)/d(loss_sum) known up front.
  virtual LossResult train(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                           Tensor& d_h, Tensor& d_w, bool overwrite_dw) const = 0;
  // Evaluation: the loss alone (no gradient, nothing kept).
  virtual LossResult evaluate(const Tensor& h, const Tensor& w, const Tensor& targets) const = 0;
  // The same over a micro-batch: what the model calls. The cross-entropy heads read mb.targets;
  // the policy head reads the RL fields too (advantages, old / ref log-probs, seq_weight).
  virtual LossResult train_batch(float scale, const Tensor& h, const Tensor& w, const MicroBatch& mb,
                                 Tensor& d_h, Tensor& d_w, bool overwrite_dw) const {
    return train(scale, h, w, mb.targets, d_h, d_w, overwrite_dw);
  }
  virtual LossResult evaluate_batch(const Tensor& h, const Tensor& w, const MicroBatch& mb) const {
    return evaluate(h, w, mb.targets);
  }
};

// Builds a head with its chunk sizes (members that do not chunk ignore them).
using LossHeadFactory = std::unique_ptr<LossHead> (*)(const LossHeadConfig& cfg);

// full_ce: materialized logits (cross_entropy.cpp).
std::unique_ptr<LossHead> make_full_ce_head(const LossHeadConfig& cfg);
// linear_ce: the fused single pass for training, the two-pass stream for evaluation
// (linear_ce.cpp).
std::unique_ptr<LossHead> make_linear_ce_head(const LossHeadConfig& cfg);
// policy: PPO / GRPO / GSPO objectives over a micro-batch's RL fields, streamed as linear_ce's
// fused pass (policy.cpp; policy.h). Its train / evaluate without a micro-batch throw.
std::unique_ptr<LossHead> make_policy_head(const LossHeadConfig& cfg);

}  // namespace bb
