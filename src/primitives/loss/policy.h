// policy.h — the policy loss head (primitives.loss = "policy"): PPO / GRPO / DAPO / GSPO-family
// objectives on the streaming loss head, without a [T, V] logits tensor in forward or backward.
//
// Legend: T tokens, H hidden, V vocab; h [T, H], w [V, H] (f32 or bf16), targets [T] i32
// (< 0 = no loss at this position). Per valid position t, at temperature tau:
//   z_t        = (h_t . w^T) / tau                               the tempered logits [V]
//   logp_t     = z_t[target_t] - logsumexp(z_t)                  log-prob of the sampled token
//   H_t        = -sum_v p_tv log p_tv,  p_t = softmax(z_t)       entropy
//   lr_t       = logp_t - old_t (ratio = token), or the sequence's mean of it (ratio = sequence,
//                GSPO); clamped to [-max_log_ratio, max_log_ratio]; r_t = exp(lr_t)
//   pg_t       = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
//                and, with dual_clip c > 1 and A_t < 0: pg_t = min(pg_t, -A_t c)
//   kl_t       = k1: logp_t - ref_t;  k3: exp(d) - d - 1, d = ref_t - logp_t (clamped as lr)
//   L_t        = pg_t + kl_coef kl_t - entropy_coef H_t
//   loss_sum   = sum_t w_t L_t,  w_t = seq_weight_t for seq_mean_token_mean, else 1
// The objective is scale x loss_sum; the caller picks scale from the aggregation
// (policy_config.h): 1 / (valid tokens of the step) or 1 / (sequences of the step).
// Gradients (per valid row, g_lp = scale w_t dL/dlogp, g_H = scale w_t dL/dH = -scale w_t
// entropy_coef):
//   dL/dlogp   = dpg/dr x r + kl_coef dkl/dlogp,  dpg/dr = -A where the unclipped term is taken,
//                0 where a clip is (GSPO-token form for ratio = sequence: d r_t / d logp_t = s)
//   d z_tv     = g_lp (onehot_v - p_tv) - g_H p_tv (log p_tv + H_t);   d x = d z / tau
//   d_h (=) d x @ w,  d_w (+=) d x^T @ h
// Without old_logprobs the update is on-policy: old = logp detached, so r = 1 and dr/dlogp = 1.
// Training takes one of two block orders (policy_config.h PolicyBlocks, policy_vocab_cols):
// - the row sweep streams whole-vocabulary blocks of policy_chunk_rows(cfg.policy, T) rows (one
//   [ct, V] f32 block, the logits peak, as linear_ce_fused); ratio = sequence takes one forward
//   sweep first for the sequence ratios, then the fused sweep (the logits GEMM twice);
// - the vocab sweep streams [T, cols] column blocks twice: the row statistics merged over the
//   blocks (online log-sum-exp), every row's objective (and the sequence ratios) once, then the
//   gradient block by block, each block's rows of d_w written once, d_h summed in f32.
// Forward-only calls take the row sweep. On CUDA the same blocks with kernels (policy_cuda.h)
// between the GEMMs; with bf16 h / w the gradient is bf16, written over the f32 logits in place,
// as linear_ce_fused's.
// Accumulation convention: d_w ACCUMULATED (+=, f32 [V, H]) or written with overwrite_dw; d_h
// WRITTEN (=, any float dtype; allocated f32 under activations when undefined).
#pragma once

#include <string>

#include "primitives/loss/cross_entropy.h"

namespace bb {

// The per-token inputs of the policy loss, all f32 [T] on the host, aligned with targets.
struct PolicyTokens {
  Tensor advantages;    // required
  Tensor old_logprobs;  // the rollout's log-probs, or undefined: on-policy
  Tensor ref_logprobs;  // the reference policy's; required when kl_coef > 0 (else a metric)
  Tensor seq_weight;    // 1 / n_s at valid positions (MicroBatch::seq_weight); required for
                        // seq_mean_* aggregation, ratio = sequence and the sequences metric
  Tensor cu_seqlens;    // [B+1] i32 host; required for ratio = sequence
};

// Checks cfg (temperature > 0, clips >= 0, dual_clip 0 or > 1, kl_coef >= 0, max_log_ratio > 0);
// `where` names the source in the message.
void validate_policy_config(const PolicyLossConfig& cfg, const std::string& where);

// Training: loss_sum (= sum_t w_t L_t), num_valid, the metrics, and both gradients. For ratio =
// sequence every sequence of cu_seqlens must hold all the valid tokens of its document (the
// seq_weight of its valid tokens sums to 1); a split one is an error naming the sequence.
LossResult policy_loss_train(float scale, const Tensor& h, const Tensor& w, const Tensor& targets,
                             const PolicyTokens& in, const LossHeadConfig& cfg, Tensor& d_h,
                             Tensor& d_w, bool overwrite_dw = false);
// Evaluation: loss_sum, num_valid and the metrics, no gradient, nothing kept.
LossResult policy_loss_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                               const PolicyTokens& in, const LossHeadConfig& cfg);
// Per-token log-prob of the target and entropy at cfg.policy.temperature (forward only): logp
// and entropy [T] f32, 0 where target < 0; host tensors, allocated here (CPU and CUDA).
void policy_token_stats(const Tensor& h, const Tensor& w, const Tensor& targets,
                        const LossHeadConfig& cfg, Tensor& logp, Tensor& entropy);

// A training call's logits peak: the [policy_chunk_rows, V] f32 block of the row sweep, or the
// [T, policy_vocab_cols] f32 block of the vocab sweep.
int64_t policy_logits_bytes(int64_t num_tokens, int64_t vocab, int64_t hidden, const LossHeadConfig& cfg);
// The vocab sweep's f32 d_h accumulator [T, H] (workspace; 0 for the row sweep). With the block
// it stays within the row sweep's block (policy_vocab_cols); a d_h given in f32 is used instead.
int64_t policy_dh_accumulator_bytes(int64_t num_tokens, int64_t vocab, int64_t hidden, const LossHeadConfig& cfg);

}  // namespace bb
