// linear_cuda.h — the bias kernels of the linear primitive on CUDA (the GEMMs are cuda::gemm).
//
// Legend: T rows (tokens), O output features. Raw device pointers on `device` (made current),
// work ordered on cuda::stream(). Float dtypes f32, bf16, f16 (computed in fp32).
#pragma once

#ifdef BB_WITH_CUDA

#include <cstdint>

#include "core/dtype.h"

namespace bb::cuda {

// y[t, o] = bias[o]   (y [T, O] dtype y_dt, written; bias [O] dtype b_dt, read).
// linear_forward writes the bias into y and then runs the GEMM with beta = 1, so y is rounded
// once: y = round(x w^T + bias).
void linear_bias_broadcast(void* y, DType y_dt, const void* bias, DType b_dt, int64_t T, int64_t O,
                           int device);

// d_bias[o] += sum_t d_y[t, o]   (d_bias [O] f32, accumulated; d_y [T, O] dtype dy_dt).
// Deterministic: one CTA per 32 columns, fixed summation order.
void linear_bias_grad(float* d_bias, const void* d_y, DType dy_dt, int64_t T, int64_t O,
                      int device);

}  // namespace bb::cuda

#endif  // BB_WITH_CUDA
