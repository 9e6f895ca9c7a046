// permute_cuda.h — host-side declarations of the CUDA token-permutation kernels (permute.cpp
// dispatches here for device tensors). Raw pointers and sizes only; every launch runs on
// cuda::stream().
//
// Legend: T tokens, K top-k, E experts, H hidden, N = T*K permuted rows.
// Row order is the CPU's: grouped by expert, stable by (token, k) inside an expert (a stable
// radix sort of the expert ids). Every output row is written by one thread block, sums run in
// fp32 in a fixed order, and no float atomics are used: results are deterministic.
// Backward functions WRITE their outputs (=). Data dtypes: f32, bf16, f16.
#pragma once

#ifdef BB_WITH_CUDA

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace bb::cuda {

// Scratch bytes make_permute_map needs for N rows and E experts (sort keys, values, CUB).
size_t permute_map_workspace_bytes(int64_t N, int64_t E);

// topk_idx [T, K] i32 (in) -> row_token [N] i32, slot_row [T, K] i32 (out) and
// stats [1 + E] i32 (out): stats[1 + e] = count_e (ids outside [0, E) are not counted);
// stats[0] = 0 when every id is in range, else N - (row-major position of the first bad id).
// The caller copies stats to the host (that is the one synchronisation).
void make_permute_map(int32_t* row_token, int32_t* slot_row, int32_t* stats,
                      const int32_t* topk_idx, int64_t T, int64_t K, int64_t E, void* workspace,
                      size_t workspace_bytes);

// x_perm[slot_row[t, k]] <- x[t] for x [T, row_bytes] (so x_perm[n] = x[row_token[n]]): a bit
// copy, any dtype; each token row is read once.
void permute_rows(void* x_perm, const void* x, const int32_t* slot_row, int64_t T, int64_t K,
                  int64_t row_bytes);

// out [T, H] <- sum_k w[t, k] * in[slot_row[t, k]] with in [N, H], fp32 accumulation in k
// order, stored in dtype dt (in and out share it), or in f32 when out_f32 (the sum unrounded;
// any float rows). prob [T, K] f32 or null (w = 1).
// Serves permute_backward (prob null) and unpermute_forward.
void gather_sum_rows(void* out, const void* in, DType dt, const int32_t* slot_row,
                     const float* prob, int64_t T, int64_t K, int64_t H, bool out_f32 = false);

// d_y_perm [N, H] (dt) <- w[t, k] * d_y[t] at row slot_row[t, k]; d_prob [T, K] f32 <-
// <d_y[t], y_perm[slot_row[t, k]]> when d_prob is non-null (then y_perm [N, H] dt and prob
// are too). prob null = unit weights.
void unpermute_backward(void* d_y_perm, float* d_prob, const void* d_y, const void* y_perm,
                        DType dt, const int32_t* slot_row, const float* prob, int64_t T,
                        int64_t K, int64_t H);

// row_prob [N] <- prob [T, K] scattered through slot_row; n = T * K.
void permute_probs(float* row_prob, const float* prob, const int32_t* slot_row, int64_t n);
// d_prob [T, K] <- d_row_prob [N] gathered through slot_row; n = T * K.
void unpermute_probs_grad(float* d_prob, const float* d_row_prob, const int32_t* slot_row,
                          int64_t n);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA
