// policy_cuda.h — host-side declaration of the policy loss's row kernel (policy_cuda.cu), used
// by policy.cpp's CUDA path. Raw pointers and sizes; the launch runs on cuda::stream().
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>

#include "core/dtype.h"
#include "primitives/loss/policy_config.h"

namespace bb::cuda {

// Per-row inputs on the device, f32 [rows] each, null when absent: advantage (null = 0), the
// rollout and reference log-probs (null = NaN: on-policy / no KL), the row's weight w_t in the
// sum (null = 1) and the sequence's mean log-ratio (ratio = sequence; null otherwise).
struct PolicyRowInputs {
  const float *adv = nullptr, *old = nullptr, *ref = nullptr, *weight = nullptr, *seq_lr = nullptr;
};

// Per-row statistics the kernel writes, f32 [rows][kPolicyStats]; all 0 on a masked row.
enum PolicyStat : int {
  kStatLoss = 0,      // w_t L_t
  kStatLogp,          // log p(target) at the temperature
  kStatEntropy,       // entropy at the temperature
  kStatRatio,         // r
  kStatClipped,       // 1 when the ratio clip took the gradient away
  kStatDual,          // 1 when the dual clip did
  kStatApproxKl,      // r - 1 - log r
  kStatRefKl,         // the KL estimator to the reference (0 without it)
  kStatValid,         // 1 on a row with a target in [0, V)
  kStatBadTarget,     // 1 on a row whose target is >= V (reported by the caller)
  kPolicyStats
};

// One thread block per row of the f32 logits block x [rows, V] (row stride V): the row's
// tempered log-sum-exp, target log-prob and entropy (one sweep, online), the token's objective
// (policy_terms.h) and, with write_grad, its gradient d x = (g_lp (onehot - p) - g_H p (log p +
// H)) / tau, g = scale w_t dL/d(logp, H), written IN PLACE over the row in dtype d_dt (f32: the
// same elements; bf16: the first 2V bytes of the row, row stride 2V bf16 elements, as
// ce_fused_rows). Masked rows (and targets >= V) get a zero gradient.
void policy_rows(float* x, int64_t V, DType d_dt, bool write_grad, const int32_t* targets,
                 const PolicyLossConfig& cfg, const PolicyRowInputs& in, float scale, int64_t rows, float* stats);

// The vocab sweep (policy_vocab_cols): column blocks x [rows, cols] f32 (row stride cols) of
// the logits' columns [v0, v0 + cols). Row state acc, f64 [rows][4]: the running max m of z,
// sum exp(z - m), sum exp(z - m) (z - m) and the target's z.
// policy_col_stats: merges the block into acc (first: starts it), one warp per row; rows whose
// target is not in [0, V) are skipped.
void policy_col_stats(const float* x, int64_t cols, int64_t v0, int64_t V, const int32_t* targets, double temperature,
                      bool first, int64_t rows, double* acc);
// policy_row_terms: one thread per row, from acc: the statistics (as policy_rows) and coef, f32
// [rows][4] = {lse, entropy, g_lp, g_H} with the gradient's factors (all 0 on a masked row).
void policy_row_terms(const double* acc, int64_t V, const int32_t* targets, const PolicyLossConfig& cfg,
                      const PolicyRowInputs& in, float scale, int64_t rows, float* stats, float* coef);
// policy_col_grad: the gradient of the block from coef, IN PLACE in dtype d_dt (bf16: row stride
// 2 cols bf16 elements, as policy_rows), one warp per row; zero on rows with g_lp = g_H = 0.
void policy_col_grad(float* x, int64_t cols, int64_t v0, const int32_t* targets, double temperature,
                     const float* coef, DType d_dt, int64_t rows);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA
