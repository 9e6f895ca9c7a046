// cross_entropy_ref.h — CPU reference for the loss family (templated over the scalar type so the
// tests can run the forward in double for finite differences).
//
// Legend: T tokens (rows), V vocab, H hidden. targets[t] < 0 means "no loss at row t".
//   logits = h @ w^T                                        [T, V]
//   lse_t  = log sum_v exp(logits_tv)
//   loss   = sum_{t valid} (lse_t - logits_t[target_t])     (a sum, not a mean: the caller scales)
//   d_logits_tv = scale * (exp(logits_tv - lse_t) - [v == target_t]), 0 on masked rows
// Sums of exponentials and the loss are accumulated in double whatever T is.
//
// Two ways to get lse: `cross_entropy_forward` sees a whole row (max pass, then sum pass);
// `online_lse_update` sees one vocab chunk at a time and keeps a running (max, sum) per row, so
// linear_ce never needs a full row of logits. Keeping the two separate makes the
// linear_ce == full_ce test compare two different algorithms.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace bb::ref {

// logits[rows, V] -> lse[rows] (may be null), loss_sum, num_valid.
template <class T>
void cross_entropy_forward(T* lse, double* loss_sum, int64_t* num_valid, const T* logits,
                           const int32_t* targets, int64_t rows, int64_t V) {
  double sum = 0;
  int64_t valid = 0;
  for (int64_t t = 0; t < rows; ++t) {
    const T* x = logits + t * V;
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(x[v]));
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(static_cast<double>(x[v]) - mx);
    const double l = mx + std::log(s);
    if (lse) lse[t] = static_cast<T>(l);
    if (targets[t] >= 0) {
      sum += l - static_cast<double>(x[targets[t]]);
      ++valid;
    }
  }
  *loss_sum = sum;
  *num_valid = valid;
}

// Softmax gradient on columns [v0, v0 + nv) of the vocabulary for `rows` rows. x and d have row
// stride ld and may alias (linear_ce turns its logits chunk into d_logits in place).
template <class T>
void softmax_grad_chunk(T* d, const T* x, int64_t ld, const int32_t* targets, const T* lse, T scale,
                        int64_t rows, int64_t v0, int64_t nv) {
  for (int64_t t = 0; t < rows; ++t) {
    T* dr = d + t * ld;
    const T* xr = x + t * ld;
    if (targets[t] < 0) {
      for (int64_t j = 0; j < nv; ++j) dr[j] = T(0);
      continue;
    }
    const double l = static_cast<double>(lse[t]);
    for (int64_t j = 0; j < nv; ++j) {
      const double p = std::exp(static_cast<double>(xr[j]) - l);
      const double onehot = (v0 + j == targets[t]) ? 1.0 : 0.0;
      dr[j] = static_cast<T>(static_cast<double>(scale) * (p - onehot));
    }
  }
}

// Whole rows: d_logits[rows, V] = scale * (softmax - onehot), 0 on masked rows.
template <class T>
void cross_entropy_backward(T* d_logits, const T* logits, const int32_t* targets, const T* lse,
                            T scale, int64_t rows, int64_t V) {
  softmax_grad_chunk<T>(d_logits, logits, V, targets, lse, scale, rows, 0, V);
}

// One vocab chunk x[rows, nv] (row stride ld) holding columns [v0, v0 + nv): folds it into the
// running max / sum of exponentials (relative to that max) of each row, and records the target
// logit when the target falls inside the chunk. Start with run_max = -inf, run_sum = 0; after
// the last chunk lse = run_max + log(run_sum).
template <class T>
void online_lse_update(double* run_max, double* run_sum, double* target_logit, const T* x,
                       int64_t ld, const int32_t* targets, int64_t rows, int64_t v0, int64_t nv) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * ld;
    double chunk_max = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < nv; ++j) chunk_max = std::max(chunk_max, static_cast<double>(xr[j]));
    const double new_max = std::max(run_max[t], chunk_max);
    // Rescale what was summed against the old max; exp(-inf) = 0 covers the first chunk.
    double s = run_sum[t] * std::exp(run_max[t] - new_max);
    for (int64_t j = 0; j < nv; ++j) s += std::exp(static_cast<double>(xr[j]) - new_max);
    run_max[t] = new_max;
    run_sum[t] = s;
    const int64_t tgt = targets[t];
    if (tgt >= v0 && tgt < v0 + nv) target_logit[t] = static_cast<double>(xr[tgt - v0]);
  }
}

// logits[rows, V] = h[rows, H] @ w[V, H]^T, plain loops with double accumulation (the Tensor
// API uses BLAS; this is the oracle the tests run in double).
template <class T>
void lm_head_logits(T* logits, const T* h, const T* w, int64_t rows, int64_t V, int64_t H) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += static_cast<double>(h[t * H + k]) * w[v * H + k];
      logits[t * V + v] = static_cast<T>(acc);
    }
}

}  // namespace bb::ref
