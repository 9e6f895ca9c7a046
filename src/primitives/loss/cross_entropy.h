// cross_entropy.h — the loss family baseline: plain cross-entropy on logits, and the `full_ce`
// loss head (materialize logits = h @ w^T, then cross-entropy). `linear_ce.h` is the streaming
// alternative with the same interface.
//
// Legend: T tokens, H hidden, V vocab.
//   targets [T]    i32 (CPU); target < 0 = no loss at this position (masked / sequence end);
//                  otherwise 0 <= target < V
//   logits  [T, V] f32 or bf16
//   h       [T, H] f32 or bf16 (final hidden states, after the last norm)
//   w       [V, H] f32 or bf16 (LM head weight, Hugging Face lm_head layout)
// Formula: loss_sum = sum_{t valid} (lse_t - logits_t[target_t]),
//          lse_t    = log sum_v exp(logits_tv).
// The loss is a SUM over valid tokens; the caller divides (e.g. by the valid tokens of the whole
// step across micro-batches and ranks) and passes that factor back as `scale` to the backward.
//
// Accumulation convention of the backwards in this family: parameter gradients (d_w) are
// ACCUMULATED (+=), activation gradients (d_h, d_logits) are WRITTEN (=).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "primitives/loss/policy_config.h"

namespace bb {

struct LossResult {
  double loss_sum = 0;    // sum over valid tokens of -log p(target) (policy: of w_t L_t, policy.h)
  int64_t num_valid = 0;  // tokens with target >= 0
  PolicyMetrics policy;   // the policy loss's sums (zero for the cross-entropy heads)
};

// Forward of plain cross-entropy. If lse_out is non-null it receives lse [T] f32: written into
// *lse_out when it is defined (must be [T] f32), else allocated under activations. Saves nothing
// itself.
LossResult cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor* lse_out);
// Returns d_logits [T, V] f32 (category logits) = scale * (softmax(logits) - onehot(target)) on
// valid rows, 0 on masked rows. lse: [T] f32 from cross_entropy_forward.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                              float scale);

// linear_ce only: chunk sizes of the streamed logits blocks (need not divide T or V).
//   chunk_tokens x chunk_vocab: the two-pass linear_ce_forward / linear_ce_backward blocks.
//   fused_chunk_tokens: token rows of linear_ce_fused's whole-vocabulary block; its logits peak
//     is min(fused_chunk_tokens, T) * V * 4 bytes (the gradient overwrites the block in place).
//     2048 keeps that at 1.16 GiB for V = 151936 while the d_w GEMM (K = 2048) stays
//     compute-bound; see skills/loss-linear-ce.md.
//   bf16_logits (linear_ce): logits at bf16 precision instead of f32 (primitives.loss_logits);
//     halves the fused block's bytes and traffic with bf16 h/w on CUDA; see linear_ce.h.
//   policy: the policy loss's objective (the [policy] table; policy.h); the policy head streams
//     whole-vocabulary blocks of fused_chunk_tokens rows, like linear_ce_fused.
struct LossHeadConfig {
  int64_t chunk_tokens = 4096;
  int64_t chunk_vocab = 32768;
  int64_t fused_chunk_tokens = 2048;
  bool bf16_logits = false;
  PolicyLossConfig policy;
};

// What a loss head forward saves for its backward (owned by the caller).
struct LossHeadSaved {
  Tensor logits;  // full_ce: [T, V] f32, category logits; linear_ce: undefined (recomputed)
  Tensor lse;     // [T] f32, category activations
};

// Logits for inspection: h @ w^T -> [T, V] f32, category logits (what full_ce materializes).
Tensor lm_head_logits(const Tensor& h, const Tensor& w);

// full_ce: logits = h @ w^T materialized ([T, V] f32, category logits), then cross-entropy.
// `saved` may be null (evaluation: the logits are freed on return).
LossResult full_ce_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                           LossHeadSaved* saved);
// scale = d(total loss) / d(loss_sum). Allocates d_logits [T, V] f32 (category logits) while
// saved.logits is still alive, so the logits peak of a step is 2 * T * V * 4 bytes.
//   d_h [T, H] (=): any float dtype (computed in f32, stored in d_h's dtype); if undefined on
//                   entry it is allocated as f32 under activations.
//   d_w [V, H] f32 (+=): must be defined.
void full_ce_backward(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                      const LossHeadSaved& saved, Tensor& d_h, Tensor& d_w);

namespace detail {
// Boundary checks shared by the loss heads (full_ce, linear_ce). `op` names the caller.
struct LossHeadDims {
  int64_t num_tokens = 0, vocab = 0, hidden = 0;
};
LossHeadDims check_loss_head_inputs(const Tensor& h, const Tensor& w, const Tensor& targets,
                                    const char* op);
// Checks saved.lse, d_w and d_h (allocating d_h as described at full_ce_backward).
void check_loss_head_grads(const LossHeadDims& dims, const Tensor& h, const LossHeadSaved& saved,
                           Tensor& d_h, const Tensor& d_w, const char* op);
// d_w [V, H] f32 (+=) must be given; d_h [T, H] (=) is allocated f32 under activations when
// undefined. The checks every head's gradient call shares.
void check_head_grad_args(const LossHeadDims& dims, const Tensor& h, Tensor& d_h,
                          const Tensor& d_w, const char* op);
#ifdef BB_WITH_CUDA
// targets as an i32 tensor on `dev` (a workspace copy when they live elsewhere).
Tensor targets_on(const Tensor& targets, Device dev);
// The end of every CUDA loss head: lse [T] f32 from the running max / sum (device [T] each),
// loss sum and valid count read back once, and the error for a target >= V (device targets are
// only checked here); `consequence` is appended to that message.
LossResult finish_ce_cuda(float* lse, const float* run_max, const float* run_sum,
                          const float* target_logit, const Tensor& targets_dev, int64_t T,
                          int64_t V, const char* op, const char* consequence = "");
#endif
}  // namespace detail

}  // namespace bb
