// policy_terms.h — the per-token objective of the policy loss and its derivatives (policy.h),
// one function for the CPU path and the CUDA kernel (host and device).
#pragma once

#include <math.h>

#include "primitives/loss/policy_config.h"

#ifdef __CUDACC__
#define BB_POLICY_HD __host__ __device__
#else
#define BB_POLICY_HD
#endif

namespace bb::policy {

struct TokenTerms {
  double loss = 0, d_logp = 0, d_entropy = 0, ratio = 1, log_ratio = 0, ref_kl = 0;
  bool clipped = false, dual_clipped = false;
};

// One valid token: its log-prob and entropy at the temperature, its advantage, and the rollout
// and reference log-probs (NaN when absent); seq_lr: the sequence's mean log-ratio
// (ratio = sequence), NaN for ratio = token.
BB_POLICY_HD inline TokenTerms token_terms(const PolicyLossConfig& c, double logp, double entropy, double adv,
                                           double old, double ref, double seq_lr) {
  TokenTerms o;
  const double lim = c.max_log_ratio;
  double lr = 0;
  if (!isnan(seq_lr)) lr = seq_lr;
  else if (!isnan(old)) lr = logp - old;
  const bool lr_clamped = lr > lim || lr < -lim;
  o.log_ratio = fmin(fmax(lr, -lim), lim);
  const double r = exp(o.log_ratio);
  o.ratio = r;
  const double unclipped = -adv * r;
  const double clipped = -adv * fmin(fmax(r, 1.0 - c.clip_low), 1.0 + c.clip_high);
  double pg = unclipped, dpg_dr = -adv;
  if (clipped > unclipped) {  // only possible with r outside the clip range: no gradient
    pg = clipped;
    dpg_dr = 0;
    o.clipped = true;
  }
  if (c.dual_clip > 0 && adv < 0 && pg > -adv * c.dual_clip) {
    pg = -adv * c.dual_clip;
    dpg_dr = 0;
    o.dual_clipped = true;
  }
  // dr/dlogp: r (token: r = exp(logp - old); sequence: GSPO-token's sg(s) exp(logp - sg(logp));
  // on-policy: exp(logp - sg(logp)) = 1); 0 where the log-ratio was clamped.
  const double dr = lr_clamped ? 0.0 : r;
  o.loss = pg;
  o.d_logp = dpg_dr * dr;
  if (!isnan(ref)) {
    const double d = ref - logp;
    const bool d_clamped = d > lim || d < -lim;
    const double dc = fmin(fmax(d, -lim), lim);
    double kl, dkl;
    if (c.kl == KlEstimator::k1) {
      kl = -d;
      dkl = 1;
    } else {
      kl = exp(dc) - dc - 1.0;
      dkl = d_clamped ? 0.0 : 1.0 - exp(dc);  // d kl / d logp = (exp(d) - 1) x (-1)
    }
    o.ref_kl = kl;
    if (c.kl_coef != 0) {
      o.loss += c.kl_coef * kl;
      o.d_logp += c.kl_coef * dkl;
    }
  }
  o.loss -= c.entropy_coef * entropy;
  o.d_entropy = -c.entropy_coef;
  return o;
}

// Row statistics in the shifted form over a set of columns: the max m of z, s = sum exp(z - m)
// and sz = sum exp(z - m) (z - m); s = 0 for an empty set. Merges (bm, bs, bsz) into (m, s, sz),
// both moved to M = max(m, bm): sum e' (z - M) = k (sum e (z - m) + (m - M) sum e), k = e^(m-M).
// lse = m + log s, entropy = log s - sz / s. The vocab sweep's CPU path and CUDA kernels.
BB_POLICY_HD inline void merge_shifted(double& m, double& s, double& sz, double bm, double bs, double bsz) {
  if (bs == 0.0) return;
  if (s == 0.0) {
    m = bm, s = bs, sz = bsz;
    return;
  }
  const double M = fmax(m, bm), ka = exp(m - M), kb = exp(bm - M);
  sz = ka * (sz + (m - M) * s) + kb * (bsz + (bm - M) * bs);
  s = ka * s + kb * bs;
  m = M;
}

}  // namespace bb::policy
