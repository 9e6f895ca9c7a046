// router_ref.h — CPU reference of the MoE router, templated over the scalar type.
//
// Plain loops on raw pointers. The forward is split into its pieces (scores, selection,
// weights, losses) so that a test can hold the selection fixed and run the differentiable
// pieces in double for finite differences. Legend: T tokens (num_tokens), E experts, K top-k.
// router_backward WRITES d_logits (=). Loss sums accumulate in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "primitives/activation/swiglu_ref.h"  // ref::stable_sigmoid
#include "primitives/moe/router.h"             // RouterConfig, RouterScore

namespace bb::ref {

// scores [T, E] <- softmax_e(logits) or sigmoid(logits); logits [T, E].
template <class T>
void router_scores(T* scores, const T* logits, int64_t num_tokens, int64_t E, RouterScore kind) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* l = logits + t * E;
    T* s = scores + t * E;
    if (kind == RouterScore::sigmoid) {
      for (int64_t e = 0; e < E; ++e) s[e] = stable_sigmoid(l[e]);
      continue;
    }
    T m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e] - m));
    for (int64_t e = 0; e < E; ++e)
      s[e] = static_cast<T>(std::exp(static_cast<double>(l[e] - m)) / sum);
  }
}

// topk_idx [T, K] <- the K experts of largest selection score scores + bias (bias [E] or null),
// in decreasing order; ties go to the lower expert id. With cfg.num_groups > 1 only experts of
// the cfg.topk_groups best groups are eligible (group score = sum of its two best selection
// scores, or its best if groups have one expert; ties go to the lower group id).
template <class T>
void router_select(int32_t* topk_idx, const T* scores, const T* bias, int64_t num_tokens,
                   const RouterConfig& cfg) {
  const int64_t E = cfg.num_experts, K = cfg.top_k, G = cfg.num_groups;
  const int64_t group_size = E / G;
  std::vector<T> sel(E), group_score(G);
  std::vector<char> eligible(E), taken(E), group_taken(G);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t e = 0; e < E; ++e) sel[e] = scores[t * E + e] + (bias ? bias[e] : T(0));
    std::fill(eligible.begin(), eligible.end(), 1);
    if (G > 1) {
      for (int64_t g = 0; g < G; ++g) {
        const T* s = sel.data() + g * group_size;
        int64_t b1 = 0;
        for (int64_t j = 1; j < group_size; ++j)
          if (s[j] > s[b1]) b1 = j;
        int64_t b2 = -1;
        for (int64_t j = 0; j < group_size; ++j)
          if (j != b1 && (b2 < 0 || s[j] > s[b2])) b2 = j;
        group_score[g] = s[b1] + (b2 >= 0 ? s[b2] : T(0));
      }
      std::fill(group_taken.begin(), group_taken.end(), 0);
      for (int64_t i = 0; i < cfg.topk_groups; ++i) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; ++g)
          if (!group_taken[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
        group_taken[best] = 1;
      }
      for (int64_t e = 0; e < E; ++e) eligible[e] = group_taken[e / group_size];
    }
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      // Strict '>' while scanning upwards keeps the lower id on ties.
      for (int64_t e = 0; e < E; ++e)
        if (eligible[e] && !taken[e] && (best < 0 || sel[e] > sel[best])) best = e;
      taken[best] = 1;
      topk_idx[t * K + k] = static_cast<int32_t>(best);
    }
  }
}

// topk_prob [T, K] <- scaling * s[t, idx] / (norm ? sum_k s[t, idx_k] : 1); scores [T, E].
template <class T>
void router_weights(T* topk_prob, const T* scores, const int32_t* topk_idx, int64_t num_tokens,
                    int64_t E, int64_t K, bool norm, T scaling) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* s = scores + t * E;
    const int32_t* idx = topk_idx + t * K;
    T denom = T(1);
    if (norm) {
      denom = T(0);
      for (int64_t k = 0; k < K; ++k) denom += s[idx[k]];
    }
    for (int64_t k = 0; k < K; ++k) topk_prob[t * K + k] = scaling * s[idx[k]] / denom;
  }
}

// counts [E] <- number of (t, k) with topk_idx[t, k] == e.
inline void router_counts(int64_t* counts, const int32_t* topk_idx, int64_t num_tokens, int64_t E,
                          int64_t K) {
  std::fill(counts, counts + E, int64_t{0});
  for (int64_t i = 0; i < num_tokens * K; ++i) ++counts[topk_idx[i]];
}

// Switch-style aux loss: E * sum_e (count_e / T) * mean_t p_te, where p = the softmax probs
// (kind softmax) or the sigmoid scores normalised per token (kind sigmoid).
template <class T>
double router_aux_loss(const T* scores, const int64_t* counts, int64_t num_tokens, int64_t E,
                       RouterScore kind) {
  std::vector<double> mean_p(E, 0.0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* s = scores + t * E;
    double denom = 1;
    if (kind == RouterScore::sigmoid) {
      denom = 0;
      for (int64_t e = 0; e < E; ++e) denom += s[e];
    }
    for (int64_t e = 0; e < E; ++e) mean_p[e] += static_cast<double>(s[e]) / denom;
  }
  double loss = 0;
  const double nt = static_cast<double>(num_tokens);
  for (int64_t e = 0; e < E; ++e) loss += (static_cast<double>(counts[e]) / nt) * (mean_p[e] / nt);
  return static_cast<double>(E) * loss;
}

// z loss: mean_t (logsumexp_e logits_te)^2.
template <class T>
double router_z_loss(const T* logits, int64_t num_tokens, int64_t E) {
  double sum = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* l = logits + t * E;
    double m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, static_cast<double>(l[e]));
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(static_cast<double>(l[e]) - m);
    const double lse = m + std::log(z);
    sum += lse * lse;
  }
  return sum / static_cast<double>(num_tokens);
}

// d_logits [T, E] <- gradient of  sum(d_topk_prob * topk_prob) + d_aux * aux + d_z * z
// with the selection topk_idx [T, K] held fixed. d_topk_prob [T, K] or null (= zeros);
// logits, scores [T, E] from the forward.
template <class T>
void router_backward(T* d_logits, const T* d_topk_prob, double d_aux, double d_z, const T* logits,
                     const T* scores, const int32_t* topk_idx, int64_t num_tokens,
                     const RouterConfig& cfg) {
  const int64_t E = cfg.num_experts, K = cfg.top_k;
  const T c = static_cast<T>(cfg.routed_scaling);
  std::vector<int64_t> counts(E);
  router_counts(counts.data(), topk_idx, num_tokens, E, K);
  const double nt = static_cast<double>(num_tokens);
  // d aux / d p_te = E * count_e / T^2 (counts are constants).
  std::vector<T> dp_aux(E);
  for (int64_t e = 0; e < E; ++e)
    dp_aux[e] = static_cast<T>(d_aux * static_cast<double>(E * counts[e]) / (nt * nt));
  std::vector<T> ds(E);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* s = scores + t * E;
    const T* l = logits + t * E;
    const int32_t* idx = topk_idx + t * K;
    T* dl = d_logits + t * E;
    std::fill(ds.begin(), ds.end(), T(0));
    // Combine weights w_k = c * s_k / S (S = sum of selected scores, or 1 without norm).
    if (d_topk_prob) {
      const T* dw = d_topk_prob + t * K;
      if (cfg.norm_topk_prob) {
        T S = 0, dot = 0;
        for (int64_t k = 0; k < K; ++k) {
          S += s[idx[k]];
          dot += dw[k] * s[idx[k]];
        }
        for (int64_t k = 0; k < K; ++k) ds[idx[k]] += c * (dw[k] / S - dot / (S * S));
      } else {
        for (int64_t k = 0; k < K; ++k) ds[idx[k]] += c * dw[k];
      }
    }
    // Aux loss through p: p = s (softmax) or p = s / sum(s) (sigmoid).
    if (cfg.score == RouterScore::softmax) {
      for (int64_t e = 0; e < E; ++e) ds[e] += dp_aux[e];
    } else {
      T S = 0, dot = 0;
      for (int64_t e = 0; e < E; ++e) S += s[e];
      for (int64_t e = 0; e < E; ++e) dot += dp_aux[e] * s[e] / S;
      for (int64_t e = 0; e < E; ++e) ds[e] += (dp_aux[e] - dot) / S;
    }
    // Scores -> logits.
    if (cfg.score == RouterScore::softmax) {
      T dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += ds[e] * s[e];
      for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * (ds[e] - dot);
    } else {
      for (int64_t e = 0; e < E; ++e) dl[e] = ds[e] * s[e] * (T(1) - s[e]);
    }
    // z loss: d (lse^2 / T) / d l_e = 2 lse softmax_e / T.
    double m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, static_cast<double>(l[e]));
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(static_cast<double>(l[e]) - m);
    const double lse = m + std::log(z);
    for (int64_t e = 0; e < E; ++e)
      dl[e] += static_cast<T>(d_z * 2.0 * lse * std::exp(static_cast<double>(l[e]) - lse) / nt);
  }
}

// bias_e += rate * sign(mean_count - count_e); bias, counts [E].
template <class T>
void update_expert_bias(T* bias, const int64_t* counts, int64_t E, T rate) {
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += static_cast<double>(counts[e]);
  mean /= static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    const double gap = mean - static_cast<double>(counts[e]);
    bias[e] += gap > 0 ? rate : (gap < 0 ? -rate : T(0));
  }
}

}  // namespace bb::ref
