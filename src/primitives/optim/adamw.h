// adamw.h — AdamW with fp32 master weights and decoupled weight decay; gradient norms.
//
// One flat parameter tensor at a time (the runtime keeps one per parameter or per bucket):
//   master      [n] f32 (optimizer)   fp32 copy of the weights, updated in place
//   grad        [n] f32 (grads)       gradient (already clipped / scaled by the caller)
//   exp_avg     [n] f32 (optimizer)   first moment, updated in place
//   exp_avg_sq  [n] f32 (optimizer)   second moment, updated in place
//   model       [n] f32/bf16 (params), optional: receives the new weights in the same pass
// Update (matches torch.optim.AdamW):
//   p <- p * (1 - lr * wd)
//   m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
//   p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#pragma once

#include <vector>

#include "core/tensor.h"

namespace bb {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  // The gradient is used as grad_scale * grad (gradient clipping folded into the update, so the
  // gradients are not rewritten in a separate pass); grad itself is not modified.
  double grad_scale = 1.0;
};

// step is 1-based. lr and weight_decay are per call (schedules and no-decay groups).
// `nonfinite`, if given, is an i32 [1] tensor on the master's device that the same pass sets to
// 1 when any updated master or moment element is Inf or NaN (it is never cleared here: one flag
// can collect several calls). The trainer's non-finite guard reads it with the step's one sync.
void adamw_step(Tensor& master, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                int64_t step, double lr, double weight_decay, const AdamWConfig& cfg,
                Tensor* model /* may be null */, Tensor* nonfinite = nullptr);

// flags[i] (i32, on the tensors' device) is set to 1 when tensor i (f32 or bf16) holds an Inf
// or NaN; flags are never cleared here. One launch per tensor on a GPU, no host sync.
void mark_nonfinite(const std::vector<Tensor>& ts, Tensor& flags);

// sum of squares of a float tensor, accumulated in double.
double sum_of_squares(const Tensor& g);
// sqrt(sum over tensors of sum of squares).
double global_grad_norm(const std::vector<Tensor>& grads);
// g *= s (f32 tensors).
void scale_inplace(Tensor& g, float s);

}  // namespace bb
