// experts_cuda.h — the small row kernels of the expert MLPs on CUDA (the GEMMs are cuda::gemm /
// cuda::gemm_grouped, SwiGLU is swiglu_cuda).
//
// Legend: N permuted rows, F ffn dim. Raw device pointers on `device` (made current), work on
// cuda::stream(). `dt` is the dtype of the [N, F] tensors: f32, bf16 or f16 (fp32 math).
// row_prob and d_row_prob are f32.
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>

#include "core/dtype.h"

namespace bb::cuda {

// out[n, j] = row_prob[n] * act[n, j]      (out written; may not alias act)
void experts_scale_rows(void* out, const void* act, DType dt, const float* row_prob, int64_t N,
                        int64_t F, int device);

// d_row_prob[n] = sum_j d_a[n, j] * act[n, j]   (written, fp32 sum of the stored values)
// d_a[n, j]    *= row_prob[n]                  (in place)
// The backward of a = p * act: d_p = <d_a, act>, d_act = p * d_a. One warp per row.
void experts_prob_backward(float* d_row_prob, void* d_a, const void* act, DType dt,
                           const float* row_prob, int64_t N, int64_t F, int device);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA
