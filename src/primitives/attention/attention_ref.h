// attention_ref.h — CPU reference for causal GQA attention over packed sequences (`sdpa`).
//
// Legend: T tokens (all sequences packed), B sequences, S one sequence's length, Hq query heads,
// Hkv key/value heads, D head dim, G = Hq / Hkv query heads per kv head.
// Layouts (row-major): q, o, dq, d_o [T, Hq, D]; k, v, dk, dv [T, Hkv, D]; lse [Hq, T].
// Sequence b owns tokens [cu[b], cu[b+1]); query head h reads kv head h / G.
//
// Forward, for a query row i of a sequence starting at token t0 (keys j = t0..i):
//   s_ij   = scale * q_i . k_j
//   lse_i  = log sum_j exp(s_ij)           (computed as m_i + log sum_j exp(s_ij - m_i))
//   o_i    = sum_j exp(s_ij - lse_i) v_j
// Backward (flash-attention style: P is recomputed from the saved lse, never stored):
//   p_ij   = exp(s_ij - lse_i)    dp_ij = dO_i . v_j    D_i = dO_i . o_i
//   ds_ij  = p_ij (dp_ij - D_i)
//   dq_i   = scale * sum_j ds_ij k_j
//   dk_j   = scale * sum_{h in group} sum_{i >= j} ds_ij q_i
//   dv_j   =         sum_{h in group} sum_{i >= j} p_ij dO_i
// dq, dk, dv are activation gradients: WRITTEN (=), not accumulated. A kv head's dk/dv sum over
// its G query heads here, so K/V are never repeated in memory.
//
// Templates over the storage scalar T (float, double) so tests can run the forward in double for
// finite differences; every sum is accumulated in double. Scratch is O(S) per query row in the
// forward and O(S * D) per (sequence, kv head) in the backward; no S x S matrix exists.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace bb::ref {

// o [T, Hq, D] written; lse [Hq, T] written unless null; cu [B+1] valid (checked by the caller).
template <class T>
void attention_forward(T* o, T* lse, const T* q, const T* k, const T* v, const int32_t* cu,
                       int64_t num_seqs, int64_t num_tokens, int64_t Hq, int64_t Hkv, int64_t D,
                       double scale) {
  const int64_t G = Hq / Hkv;
  std::vector<double> s_row;
  std::vector<double> acc(static_cast<size_t>(D));
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t t0 = cu[b], t1 = cu[b + 1];
    s_row.resize(static_cast<size_t>(t1 - t0));
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = t0; i < t1; ++i) {
        const T* qi = q + (i * Hq + h) * D;
        double m = -INFINITY;
        for (int64_t j = t0; j <= i; ++j) {
          const T* kj = k + (j * Hkv + hk) * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * kj[d];
          s_row[j - t0] = scale * dot;
          m = std::max(m, s_row[j - t0]);
        }
        // Subtracting the row max keeps exp() in range for large scores.
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = t0; j <= i; ++j) {
          const double p = std::exp(s_row[j - t0] - m);
          l += p;
          const T* vj = v + (j * Hkv + hk) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += p * vj[d];
        }
        T* oi = o + (i * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<T>(acc[d] / l);
        if (lse) lse[h * num_tokens + i] = static_cast<T>(m + std::log(l));
      }
    }
  }
}

// dq [T, Hq, D], dk/dv [T, Hkv, D] written; d_o, o [T, Hq, D]; lse [Hq, T] from the forward.
template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* d_o, const T* q, const T* k, const T* v,
                        const T* o, const T* lse, const int32_t* cu, int64_t num_seqs,
                        int64_t num_tokens, int64_t Hq, int64_t Hkv, int64_t D, double scale) {
  const int64_t G = Hq / Hkv;
  std::vector<double> dq_acc(static_cast<size_t>(D));
  std::vector<double> dk_acc, dv_acc;  // [S, D] of one (sequence, kv head)
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t t0 = cu[b], t1 = cu[b + 1];
    const size_t sd = static_cast<size_t>((t1 - t0) * D);
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      dk_acc.assign(sd, 0.0);
      dv_acc.assign(sd, 0.0);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        for (int64_t i = t0; i < t1; ++i) {
          const T* qi = q + (i * Hq + h) * D;
          const T* doi = d_o + (i * Hq + h) * D;
          const T* oi = o + (i * Hq + h) * D;
          const double lse_i = lse[h * num_tokens + i];
          double D_i = 0;
          for (int64_t d = 0; d < D; ++d) D_i += static_cast<double>(doi[d]) * oi[d];
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          for (int64_t j = t0; j <= i; ++j) {
            const T* kj = k + (j * Hkv + hk) * D;
            const T* vj = v + (j * Hkv + hk) * D;
            double qk = 0, dp = 0;
            for (int64_t d = 0; d < D; ++d) {
              qk += static_cast<double>(qi[d]) * kj[d];
              dp += static_cast<double>(doi[d]) * vj[d];
            }
            const double p = std::exp(scale * qk - lse_i);
            const double ds = p * (dp - D_i);
            double* dkj = dk_acc.data() + (j - t0) * D;
            double* dvj = dv_acc.data() + (j - t0) * D;
            for (int64_t d = 0; d < D; ++d) {
              dq_acc[d] += ds * kj[d];
              dkj[d] += ds * qi[d];
              dvj[d] += p * doi[d];
            }
          }
          T* dqi = dq + (i * Hq + h) * D;
          for (int64_t d = 0; d < D; ++d) dqi[d] = static_cast<T>(scale * dq_acc[d]);
        }
      }
      for (int64_t j = t0; j < t1; ++j) {
        T* dkj = dk + (j * Hkv + hk) * D;
        T* dvj = dv + (j * Hkv + hk) * D;
        for (int64_t d = 0; d < D; ++d) {
          dkj[d] = static_cast<T>(scale * dk_acc[(j - t0) * D + d]);
          dvj[d] = static_cast<T>(dv_acc[(j - t0) * D + d]);
        }
      }
    }
  }
}

}  // namespace bb::ref
