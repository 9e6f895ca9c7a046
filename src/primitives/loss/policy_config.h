// policy_config.h — the settings of the policy loss (primitives.loss = "policy", the [policy]
// table of a run) and the sums it reports. The loss itself: policy.h.
#pragma once

#include <cstdint>
#include <limits>

namespace bb {

// How the per-token losses L_t of a step become one number (w_t the token's weight):
//   token_mean            sum_t L_t / (valid tokens of the step)
//   seq_mean_token_sum    sum_t L_t / (sequences of the step)
//   seq_mean_token_mean   sum_t (L_t / n_s(t)) / (sequences of the step), n_s the valid tokens of
//                         the token's whole sequence (each sequence weighs the same)
enum class PolicyAggregation : uint8_t { token_mean, seq_mean_token_sum, seq_mean_token_mean };
// The estimator of KL(pi || pi_ref) per token, d = ref_logp - logp:
//   k1: -d        k3: exp(d) - d - 1 (unbiased, never negative; Schulman's "k3")
enum class KlEstimator : uint8_t { k1, k3 };
// The importance ratio: token (PPO, GRPO, DAPO) r_t = exp(logp_t - old_t); sequence (GSPO)
// r_t = s = exp(mean over the sequence's valid tokens of (logp - old)), with the gradient of the
// GSPO-token form (d r_t / d logp_t = s).
enum class PolicyRatio : uint8_t { token, sequence };
// The order of the head's blocks (primitives.policy_blocks):
//   rows   [rows, V] f32 blocks, one sweep: the logits GEMM once per block, but every block adds
//          its share into all of d_w (f32 [V, H] read and written: 8 V H bytes per block)
//   vocab  [T, cols] f32 blocks, two sweeps: the row statistics merged over the column blocks,
//          then the gradient (the logits GEMM twice: 8 T V H FLOPs against 6), each block
//          writing its own rows of d_w once; d_h accumulates in an f32 [T, H] buffer
//   auto   vocab where the row sweep's blocks would be small enough for the d_w traffic to cost
//          more than a second logits GEMM (policy_vocab_cols), rows elsewhere
enum class PolicyBlocks : uint8_t { auto_, rows, vocab };

struct PolicyLossConfig {
  double temperature = 1.0;  // logits are divided by it before the softmax (> 0)
  double clip_low = 0.2;     // the ratio is clipped to [1 - clip_low, 1 + clip_high] (>= 0)
  double clip_high = 0.2;
  double dual_clip = 0;      // c > 1: a token with A < 0 has its loss capped at -A c; 0 = off
  PolicyRatio ratio = PolicyRatio::token;
  PolicyAggregation aggregation = PolicyAggregation::token_mean;
  KlEstimator kl = KlEstimator::k3;
  double kl_coef = 0;        // > 0 needs ref_logprobs in the data
  double entropy_coef = 0;   // the loss subtracts entropy_coef x entropy
  // Log-ratios (and the k3 exponent) are clamped to [-max_log_ratio, max_log_ratio] before exp,
  // with no gradient through a clamped value: a stale rollout cannot overflow the step.
  double max_log_ratio = 20;
  // Token rows of the head's [rows, V] f32 logits block (primitives.loss_fused_chunk_tokens):
  // > 0 that many (at most T); 0 = auto, policy_chunk_rows' rule.
  int64_t chunk_tokens = 0;
  PolicyBlocks blocks = PolicyBlocks::auto_;
};

// The rows of the policy head's logits block for a call of T tokens (T >= 1). chunk_tokens > 0:
// min(chunk_tokens, T). Auto: the power of two at or below T / 64, clamped to [256, 2048] (and
// to T). The block then holds at most 1/64 of the call's full f32 logits from T = 16K up, which
// keeps the head below fused log-prob kernels whose memory grows with T (bench/results/
// 2026-12-05-rl-gpu.md), while 256-row blocks still keep the GEMMs on the GPU's fast path.
inline int64_t policy_chunk_rows(const PolicyLossConfig& c, int64_t T) {
  if (c.chunk_tokens > 0) return c.chunk_tokens < T ? c.chunk_tokens : T;
  int64_t rows = 256;
  while (rows < 2048 && rows * 2 * 64 <= T) rows *= 2;
  return rows < T ? rows : T;
}

// The columns of the vocab sweep's [T, cols] block for a training call of T >= 1 tokens, or 0
// for the row sweep (forward-only calls always take the row sweep: without d_w it has no traffic
// to save). The vocab sweep keeps the row sweep's memory: its block and its f32 d_h accumulator
// together hold at most the [policy_chunk_rows, V] f32 block: cols = rows V / T - H, rounded down
// to a multiple of 128 (of 8 below 1024; at least 8, at most V). Auto takes it for an auto-sized
// block with rows <= 512, T >= 4 rows and cols >= 1024: with [rows, V] blocks d_w moves 8 V H
// bytes per rows tokens, which costs more than the second logits GEMM's 2 rows V H FLOPs once
// rows < 4 F / B (F the GEMM rate, B the memory bandwidth: about 730 on an H100), and 1024
// columns keep the GEMMs on the fast path. At V = 248,320, H = 2048 that is T from 1K to about
// 45K (1792 columns from 16K).
inline int64_t policy_vocab_cols(const PolicyLossConfig& c, bool train, int64_t T, int64_t V, int64_t H) {
  if (!train || c.blocks == PolicyBlocks::rows || T < 1 || V < 1) return 0;
  const int64_t rows = policy_chunk_rows(c, T);
  int64_t cols = rows * V / T - H;
  cols = cols >= 1024 ? cols / 128 * 128 : cols / 8 * 8;
  if (c.blocks == PolicyBlocks::auto_ && (c.chunk_tokens > 0 || rows > 512 || T < 4 * rows || cols < 1024)) return 0;
  if (cols < 8) cols = 8;
  return cols < V ? cols : V;
}

// Sums over the valid tokens of one call (or, after the trainer's reductions, of a step).
struct PolicyMetrics {
  int64_t clipped = 0;        // tokens whose ratio clip took the gradient away
  int64_t dual_clipped = 0;   // tokens capped by the dual clip
  double approx_kl = 0;       // sum of r - 1 - log r: k3 estimate of KL(old || new) per token
  double entropy = 0;         // sum of the entropy (nats, at the temperature)
  double ratio = 0;           // sum of r
  double ratio_max = 0;       // the largest r (0 with no valid token)
  double ref_kl = 0;          // sum of the KL estimator to the reference (0 without ref_logprobs)
  double sequences = 0;       // sum of 1 / n_s over valid tokens: whole sequences count 1
};

}  // namespace bb
