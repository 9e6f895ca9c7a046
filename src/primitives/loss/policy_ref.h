// policy_ref.h — CPU reference of the policy loss (policy.h) on materialised logits, written
// from the textbook formulas and independently of policy.cpp's streamed implementation: whole
// rows, entropy as -sum p log p, the clipped objective as -min(r A, clip(r) A), GSPO's sequence
// ratio from the sequence's own log-probs (no stop-gradient: the tests differentiate this
// function by finite differences, so it must be a plain function of the logits).
//
// Inputs: logits [rows, V] (T scalars), targets [rows] (< 0 = no loss), adv / old / ref /
// seq_weight [rows] (old is required here; ref only when kl_coef > 0; seq_weight for
// seq_mean_token_mean and ratio = sequence), cu [B+1] sequence bounds (ratio = sequence).
// Returns sum_t w_t L_t in double, and the per-row log-probs / entropies when asked.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "primitives/loss/policy_config.h"

namespace bb::ref {

template <class T>
double policy_objective(const PolicyLossConfig& c, const T* logits, int64_t rows, int64_t V,
                        const int32_t* targets, const float* adv, const float* old,
                        const float* refp, const float* seq_weight, const int32_t* cu,
                        int64_t num_seqs, std::vector<double>* logp_out = nullptr,
                        std::vector<double>* ent_out = nullptr) {
  std::vector<double> logp(static_cast<size_t>(rows), 0.0), ent(static_cast<size_t>(rows), 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    std::vector<double> z(static_cast<size_t>(V));
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) {
      z[v] = static_cast<double>(logits[t * V + v]) / c.temperature;
      mx = std::max(mx, z[v]);
    }
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - mx);
    const double lse = mx + std::log(s);
    double h = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double lp = z[v] - lse;
      h -= std::exp(lp) * lp;
    }
    ent[t] = h;
    if (targets[t] >= 0) logp[t] = z[targets[t]] - lse;
  }
  const double lim = c.max_log_ratio;
  auto clamp = [lim](double x) { return std::min(std::max(x, -lim), lim); };
  // GSPO: each sequence's mean log-ratio over its valid tokens.
  std::vector<double> seq_lr(static_cast<size_t>(rows), 0.0);
  if (c.ratio == PolicyRatio::sequence) {
    for (int64_t b = 0; b < num_seqs; ++b) {
      double m = 0;
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t)
        if (targets[t] >= 0) m += seq_weight[t] * (logp[t] - old[t]);
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t) seq_lr[t] = m;
    }
  }
  double total = 0;
  for (int64_t t = 0; t < rows; ++t) {
    if (targets[t] < 0) continue;
    const double lr = c.ratio == PolicyRatio::sequence ? seq_lr[t] : logp[t] - old[t];
    const double r = std::exp(clamp(lr));
    const double a = adv[t];
    const double rc = std::min(std::max(r, 1.0 - c.clip_low), 1.0 + c.clip_high);
    double surrogate = std::min(r * a, rc * a);
    if (c.dual_clip > 0 && a < 0) surrogate = std::max(surrogate, c.dual_clip * a);
    double loss = -surrogate;
    if (c.kl_coef != 0) {
      const double kl = c.kl == KlEstimator::k1
                            ? logp[t] - refp[t]
                            : std::exp(clamp(refp[t] - logp[t])) - clamp(refp[t] - logp[t]) - 1.0;
      loss += c.kl_coef * kl;
    }
    loss -= c.entropy_coef * ent[t];
    const double wt =
        c.aggregation == PolicyAggregation::seq_mean_token_mean ? seq_weight[t] : 1.0;
    total += wt * loss;
  }
  if (logp_out) *logp_out = logp;
  if (ent_out) *ent_out = ent;
  return total;
}

}  // namespace bb::ref
