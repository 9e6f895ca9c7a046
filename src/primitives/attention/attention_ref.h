// attention_ref.h — CPU reference for GQA attention over packed sequences (`sdpa`), queries and
// keys packed separately (a query block against a key block, as context parallelism calls it).
//
// Legend: Tq / Tkv query / key tokens (all sequences packed), B sequences, Sq / Skv one
// sequence's query / key count, Hq query heads, Hkv key/value heads, D head dim, G = Hq / Hkv.
// Layouts (row-major): q, o, dq, d_o [Tq, Hq, D]; k, v, dk, dv [Tkv, Hkv, D]; lse [Hq, Tq].
// Sequence b owns queries [cq[b], cq[b+1]) and keys [ck[b], ck[b+1]); query head h reads kv
// head h / G. Inside a sequence, query i (0-based) sees key j (0-based) when
//   mask causal               j <= i                 (top-left aligned: Sq = Skv is self-attention)
//   mask causal_bottom_right  j <= i + (Skv - Sq)    (the queries are the last Sq key positions)
//   mask none                 always
//
// Forward, for query i with visible keys J:
//   s_ij   = scale * q_i . k_j
//   lse_i  = log sum_{j in J} exp(s_ij)     (computed as m_i + log sum_j exp(s_ij - m_i))
//   o_i    = sum_{j in J} exp(s_ij - lse_i) v_j
// A query that sees no key (an empty key block) gets o_i = 0 and lse_i = -inf, the neutral
// element when partial results are merged by their lse.
// Backward (flash-attention style: P is recomputed from the saved lse, never stored):
//   p_ij   = exp(s_ij - lse_i)    dp_ij = dO_i . v_j    D_i = dO_i . o_i
//   ds_ij  = p_ij (dp_ij - D_i)
//   dq_i   = scale * sum_j ds_ij k_j
//   dk_j   = scale * sum_{h in group} sum_{i sees j} ds_ij q_i
//   dv_j   =         sum_{h in group} sum_{i sees j} p_ij dO_i
// dq, dk, dv are activation gradients: WRITTEN (=), not accumulated. A kv head's dk/dv sum over
// its G query heads here, so K/V are never repeated in memory.
//
// Templates over the storage scalar T (float, double) so tests can run the forward in double for
// finite differences; every sum is accumulated in double. Scratch is O(Skv) per query row in the
// forward and O(Skv * D) per (sequence, kv head) in the backward; no S x S matrix exists.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace bb::ref {

// The masks of attention.h (AttentionMask), as plain ints for the reference.
enum class RefMask : int { causal = 0, causal_bottom_right = 1, none = 2 };

// Keys [0, n) of the sequence are visible to query i (0-based) of a sequence of sq queries and
// skv keys.
inline int64_t visible_keys(RefMask mask, int64_t i, int64_t sq, int64_t skv) {
  switch (mask) {
    case RefMask::causal: return std::min(i + 1, skv);
    case RefMask::causal_bottom_right: return std::max<int64_t>(0, std::min(i + 1 + skv - sq, skv));
    case RefMask::none: return skv;
  }
  return 0;
}

// o [Tq, Hq, D] written; lse [Hq, Tq] written unless null; cq, ck [B+1] valid (checked by the
// caller).
template <class T>
void attention_forward(T* o, T* lse, const T* q, const T* k, const T* v, const int32_t* cq,
                       const int32_t* ck, int64_t num_seqs, int64_t num_q_tokens, int64_t Hq,
                       int64_t Hkv, int64_t D, double scale, RefMask mask) {
  const int64_t G = Hq / Hkv;
  std::vector<double> s_row;
  std::vector<double> acc(static_cast<size_t>(D));
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q0 = cq[b], sq = cq[b + 1] - q0, k0 = ck[b], skv = ck[b + 1] - k0;
    s_row.resize(static_cast<size_t>(skv));
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < sq; ++i) {
        const T* qi = q + ((q0 + i) * Hq + h) * D;
        T* oi = o + ((q0 + i) * Hq + h) * D;
        const int64_t n = visible_keys(mask, i, sq, skv);
        if (n == 0) {
          for (int64_t d = 0; d < D; ++d) oi[d] = T(0);
          if (lse) lse[h * num_q_tokens + q0 + i] = static_cast<T>(-INFINITY);
          continue;
        }
        double m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          const T* kj = k + ((k0 + j) * Hkv + hk) * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * kj[d];
          s_row[j] = scale * dot;
          m = std::max(m, s_row[j]);
        }
        // Subtracting the row max keeps exp() in range for large scores.
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < n; ++j) {
          const double p = std::exp(s_row[j] - m);
          l += p;
          const T* vj = v + ((k0 + j) * Hkv + hk) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += p * vj[d];
        }
        for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<T>(acc[d] / l);
        if (lse) lse[h * num_q_tokens + q0 + i] = static_cast<T>(m + std::log(l));
      }
    }
  }
}

// dq [Tq, Hq, D], dk/dv [Tkv, Hkv, D] written; d_o, o [Tq, Hq, D]; lse [Hq, Tq] from the forward.
template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* d_o, const T* q, const T* k, const T* v,
                        const T* o, const T* lse, const int32_t* cq, const int32_t* ck,
                        int64_t num_seqs, int64_t num_q_tokens, int64_t num_kv_tokens, int64_t Hq,
                        int64_t Hkv, int64_t D, double scale, RefMask mask) {
  const int64_t G = Hq / Hkv;
  for (int64_t i = 0; i < num_kv_tokens * Hkv * D; ++i) dk[i] = dv[i] = T(0);
  std::vector<double> dq_acc(static_cast<size_t>(D));
  std::vector<double> dk_acc, dv_acc;  // [Skv, D] of one (sequence, kv head)
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q0 = cq[b], sq = cq[b + 1] - q0, k0 = ck[b], skv = ck[b + 1] - k0;
    const size_t sd = static_cast<size_t>(skv * D);
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      dk_acc.assign(sd, 0.0);
      dv_acc.assign(sd, 0.0);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        for (int64_t i = 0; i < sq; ++i) {
          const T* qi = q + ((q0 + i) * Hq + h) * D;
          const T* doi = d_o + ((q0 + i) * Hq + h) * D;
          const T* oi = o + ((q0 + i) * Hq + h) * D;
          const double lse_i = lse[h * num_q_tokens + q0 + i];
          const int64_t n = visible_keys(mask, i, sq, skv);
          double D_i = 0;
          for (int64_t d = 0; d < D; ++d) D_i += static_cast<double>(doi[d]) * oi[d];
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          for (int64_t j = 0; j < n; ++j) {
            const T* kj = k + ((k0 + j) * Hkv + hk) * D;
            const T* vj = v + ((k0 + j) * Hkv + hk) * D;
            double qk = 0, dp = 0;
            for (int64_t d = 0; d < D; ++d) {
              qk += static_cast<double>(qi[d]) * kj[d];
              dp += static_cast<double>(doi[d]) * vj[d];
            }
            const double p = std::exp(scale * qk - lse_i);
            const double ds = p * (dp - D_i);
            double* dkj = dk_acc.data() + j * D;
            double* dvj = dv_acc.data() + j * D;
            for (int64_t d = 0; d < D; ++d) {
              dq_acc[d] += ds * kj[d];
              dkj[d] += ds * qi[d];
              dvj[d] += p * doi[d];
            }
          }
          T* dqi = dq + ((q0 + i) * Hq + h) * D;
          for (int64_t d = 0; d < D; ++d) dqi[d] = static_cast<T>(scale * dq_acc[d]);
        }
      }
      for (int64_t j = 0; j < skv; ++j) {
        T* dkj = dk + ((k0 + j) * Hkv + hk) * D;
        T* dvj = dv + ((k0 + j) * Hkv + hk) * D;
        for (int64_t d = 0; d < D; ++d) {
          dkj[d] = static_cast<T>(scale * dk_acc[j * D + d]);
          dvj[d] = static_cast<T>(dv_acc[j * D + d]);
        }
      }
    }
  }
}

// Self-attention with the causal mask: queries and keys are the same tokens (cu [B+1]).
template <class T>
void attention_forward(T* o, T* lse, const T* q, const T* k, const T* v, const int32_t* cu,
                       int64_t num_seqs, int64_t num_tokens, int64_t Hq, int64_t Hkv, int64_t D,
                       double scale) {
  attention_forward(o, lse, q, k, v, cu, cu, num_seqs, num_tokens, Hq, Hkv, D, scale,
                    RefMask::causal);
}

template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* d_o, const T* q, const T* k, const T* v,
                        const T* o, const T* lse, const int32_t* cu, int64_t num_seqs,
                        int64_t num_tokens, int64_t Hq, int64_t Hkv, int64_t D, double scale) {
  attention_backward(dq, dk, dv, d_o, q, k, v, o, lse, cu, cu, num_seqs, num_tokens, num_tokens,
                     Hq, Hkv, D, scale, RefMask::causal);
}

}  // namespace bb::ref
