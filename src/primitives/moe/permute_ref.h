// permute_ref.h — CPU reference of MoE token permutation, templated over the scalar type.
//
// A token's K copies are gathered into N = T*K rows grouped by expert (expert 0's rows first),
// stable within an expert: ordered by token, then by k. Plain loops on raw pointers; sums in T
// (float or double; the Tensor API converts bf16 storage to f32 first).
// Legend: T tokens (num_tokens), K top-k, E experts, H hidden, N = T*K permuted rows.
// Backward functions WRITE their outputs (=); there are no parameters.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace bb::ref {

// From topk_idx [T, K] (values in [0, E)): counts [E], row_token [N] (source token of each
// permuted row) and slot_row [T, K] (permuted row of copy (t, k)). A counting sort: stable.
inline void make_permute_map(int32_t* row_token, int32_t* slot_row, int64_t* counts,
                             const int32_t* topk_idx, int64_t num_tokens, int64_t K, int64_t E) {
  std::fill(counts, counts + E, int64_t{0});
  for (int64_t i = 0; i < num_tokens * K; ++i) ++counts[topk_idx[i]];
  std::vector<int64_t> next(E, 0);  // next free row of each expert
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + counts[e - 1];
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = next[topk_idx[t * K + k]]++;
      slot_row[t * K + k] = static_cast<int32_t>(row);
      row_token[row] = static_cast<int32_t>(t);
    }
  }
}

// x_perm [N, H] <- x[row_token[n]]; x [T, H]. A pure copy, so any element type works.
template <class T>
void permute_forward(T* x_perm, const T* x, const int32_t* row_token, int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n) std::copy_n(x + row_token[n] * H, H, x_perm + n * H);
}

// d_x [T, H] <- sum_k d_x_perm[slot_row[t, k]]; d_x_perm [N, H].
template <class T>
void permute_backward(T* d_x, const T* d_x_perm, const int32_t* slot_row, int64_t num_tokens,
                      int64_t K, int64_t H) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    T* out = d_x + t * H;
    std::fill(out, out + H, T(0));
    for (int64_t k = 0; k < K; ++k) {
      const T* src = d_x_perm + static_cast<int64_t>(slot_row[t * K + k]) * H;
      for (int64_t j = 0; j < H; ++j) out[j] += src[j];
    }
  }
}

// y [T, H] <- sum_k w[t, k] * y_perm[slot_row[t, k]]; y_perm [N, H]; prob [T, K] or null (w = 1).
template <class T>
void unpermute_forward(T* y, const T* y_perm, const int32_t* slot_row, const T* prob,
                       int64_t num_tokens, int64_t K, int64_t H) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    T* out = y + t * H;
    std::fill(out, out + H, T(0));
    for (int64_t k = 0; k < K; ++k) {
      const T w = prob ? prob[t * K + k] : T(1);
      const T* src = y_perm + static_cast<int64_t>(slot_row[t * K + k]) * H;
      for (int64_t j = 0; j < H; ++j) out[j] += w * src[j];
    }
  }
}

// d_y_perm [N, H] <- w[t, k] * d_y[t] at row slot_row[t, k];
// d_prob [T, K] <- <d_y[t], y_perm[slot_row[t, k]]> (only when prob and d_prob are non-null).
template <class T>
void unpermute_backward(T* d_y_perm, T* d_prob, const T* d_y, const T* y_perm,
                        const int32_t* slot_row, const T* prob, int64_t num_tokens, int64_t K,
                        int64_t H) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* dy = d_y + t * H;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = slot_row[t * K + k];
      const T w = prob ? prob[t * K + k] : T(1);
      T* dst = d_y_perm + row * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = w * dy[j];
      if (prob && d_prob) {
        const T* yp = y_perm + row * H;
        T dot = 0;
        for (int64_t j = 0; j < H; ++j) dot += dy[j] * yp[j];
        d_prob[t * K + k] = dot;
      }
    }
  }
}

// row_prob [N] <- prob [T, K] scattered to permuted row order.
template <class T>
void permute_probs(T* row_prob, const T* prob, const int32_t* slot_row, int64_t num_tokens,
                   int64_t K) {
  for (int64_t i = 0; i < num_tokens * K; ++i) row_prob[slot_row[i]] = prob[i];
}

// d_prob [T, K] <- d_row_prob [N] gathered back to (t, k) order.
template <class T>
void unpermute_probs_grad(T* d_prob, const T* d_row_prob, const int32_t* slot_row,
                          int64_t num_tokens, int64_t K) {
  for (int64_t i = 0; i < num_tokens * K; ++i) d_prob[i] = d_row_prob[slot_row[i]];
}

}  // namespace bb::ref
